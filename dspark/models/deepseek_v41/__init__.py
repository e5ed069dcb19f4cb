"""DeepSeek-V4.1 target model: config and CSA2 schedule, model with rewindable decode state,
Engram hashing, official checkpoint reading and writing."""

from dspark.models.deepseek_v41.config import DeepseekV41Config
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM, DeepseekV41Output
from dspark.models.deepseek_v41.replay import BOUNDED_REPLAY, EXACT, PREFILL_MODES
from dspark.models.deepseek_v41.roles import LayerRole
from dspark.models.deepseek_v41.state import DecodeStateV41

__all__ = ["BOUNDED_REPLAY", "EXACT", "PREFILL_MODES", "DecodeStateV41", "DeepseekV41Config",
           "DeepseekV41ForCausalLM", "DeepseekV41Output", "LayerRole"]
