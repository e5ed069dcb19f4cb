"""Building an `HFCausalLM` from a transformers model object or from a checkpoint directory.

`dspark.load_model` sends here every model object that is a transformers `PreTrainedModel`, and
every directory whose `config.json` names a `model_type` that transformers knows as a causal LM and
that is not one of dspark's own families (DeepSeek-V4 / V4.1 keep their native implementations).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.models.hf_causal.config import DraftStageShape
from dspark.models.hf_causal.model import HFCausalLM

OPTIONS = frozenset({"tokenizer", "draft_stage"})


def is_transformers_causal_lm(model_type) -> bool:
    """Whether transformers maps `model_type` to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _stage(draft_stage) -> DraftStageShape | None:
    if draft_stage is None or isinstance(draft_stage, DraftStageShape):
        return draft_stage
    if isinstance(draft_stage, dict):
        return DraftStageShape(**draft_stage)
    raise ValueError(f"draft_stage: expected a DraftStageShape or a dict of its fields, got {draft_stage!r}")


def _check_options(options: dict) -> None:
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise ValueError(f"transformers causal LM: unknown option(s) {unknown}; accepted: {', '.join(sorted(OPTIONS))}")


def wrap_hf_model(hf_model, device=None, dtype: torch.dtype | None = None, **options) -> HFCausalLM:
    """Wrap a transformers model object; moved to `device` / cast to `dtype` only when they are given.

    Options: `tokenizer` (default: the model's `tokenizer` attribute, if any) and `draft_stage`.
    """
    _check_options(options)
    if device is not None or dtype is not None:
        hf_model = hf_model.to(device=device, dtype=dtype)
    tokenizer = options.get("tokenizer", getattr(hf_model, "tokenizer", None))
    return HFCausalLM(hf_model, tokenizer, _stage(options.get("draft_stage"))).eval().requires_grad_(False)


def load_hf_directory(path: Path, device, dtype: torch.dtype, **options) -> HFCausalLM:
    """`AutoModelForCausalLM.from_pretrained(path)` (and its tokenizer, when the directory has one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow imports, only when needed

    _check_options(options)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
    tokenizer = options.get("tokenizer")
    if tokenizer is None and any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return HFCausalLM(hf_model, tokenizer, _stage(options.get("draft_stage"))).eval().requires_grad_(False)
