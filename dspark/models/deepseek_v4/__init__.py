"""DeepSeek-V4 target model: config, model with rewindable decode state, HF key translation."""

from dspark.models.deepseek_v4.config import DeepseekV4Config, RopeParameters
from dspark.models.deepseek_v4.model import DeepseekV4ForCausalLM, DeepseekV4Output
from dspark.models.deepseek_v4.state import DecodeState

__all__ = ["DecodeState", "DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4Output", "RopeParameters"]
