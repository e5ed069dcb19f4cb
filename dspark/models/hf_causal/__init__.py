"""Any transformers decoder-only causal LM as a dspark target (`HFCausalLM`); see `model.py`."""

from dspark.models.hf_causal.config import DraftStageShape, HFTargetConfig, check_rewindable
from dspark.models.hf_causal.load import is_transformers_causal_lm, load_hf_directory, wrap_hf_model
from dspark.models.hf_causal.model import HFCausalLM, HFCausalOutput
from dspark.models.hf_causal.state import HFDecodeState

__all__ = ["DraftStageShape", "HFCausalLM", "HFCausalOutput", "HFDecodeState", "HFTargetConfig",
           "check_rewindable", "is_transformers_causal_lm", "load_hf_directory", "wrap_hf_model"]
