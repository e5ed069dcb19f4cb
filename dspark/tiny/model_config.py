"""Model configs for pretraining: the shipped dspark-tiny config, and fitting any config to a tokenizer.

A config dict is either flat (DeepSeek-V4) or composite with a `text_config` (DeepSeek-V4.1);
everything here edits the text section and the top-level token ids, so it serves both families
through `dspark.init_model` without knowing their classes.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from tokenizers import Tokenizer

from dspark.api import MODEL_FAMILIES
from dspark.tiny.tokenizer import special_ids

DSPARK_TINY = "dspark-tiny"
# Construction options pretraining wants where a family accepts them: every row of a training
# sequence must be computed ("exact", not the bounded-replay prefill that skips decoder rows), and
# the cache QAT casts are switched off because they round gradients to FP8/FP4 too (see
# docs/dspark-tiny.md, "Known limits").
TRAINING_OPTIONS = MappingProxyType({"prefill_mode": "exact", "cache_qat": False})


def load_config(name_or_path: str | Path) -> dict:
    """`dspark-tiny` (the shipped config), a `config.json`, or a checkpoint directory holding one."""
    if str(name_or_path) == DSPARK_TINY:
        return json.loads(resources.files("dspark.tiny").joinpath(f"{DSPARK_TINY}.json").read_text())
    path = Path(name_or_path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"config {str(name_or_path)!r}: neither {DSPARK_TINY!r} nor an existing config file")
    return json.loads(file.read_text())


def text_section(config: dict) -> dict:
    """The dict holding the text model's keys (`text_config` of a composite config, else the config)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def fit_config(config: dict, tok: Tokenizer) -> dict:
    """A copy of `config` whose token-dependent keys match `tok`.

    Sets `vocab_size`, the top-level `bos/eos/pad_token_id`, and where the family has them the
    DSpark noise id and the Engram pad id and compressed vocabulary (deepseek_v41 spec §8.1: the
    Engram hash multipliers depend on the number of compressed ids, so it must come from the
    tokenizer the model is trained with).
    """
    ids = special_ids(tok)
    fitted = copy.deepcopy(config)
    text = text_section(fitted)
    text["vocab_size"] = tok.get_vocab_size()
    fitted.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    if "dspark_noise_token_id" in text:
        text["dspark_noise_token_id"] = ids["noise"]
    if text.get("engram_layer_ids"):
        from dspark.models.deepseek_v41.engram_hash import build_token_map  # Engram configs only

        text["engram_compressed_vocab_size"] = build_token_map(tok)[1]
        pad_key = "engram_pad_id" if "engram_pad_id" in text else "engram_pad_token_id"
        text[pad_key] = ids["pad"]
    return fitted


def training_options(config: dict, cache_qat: bool = False) -> dict:
    """The subset of :data:`TRAINING_OPTIONS` (with `cache_qat` as given) that the family accepts."""
    model_type = config.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not one of {sorted(MODEL_FAMILIES)}")
    wanted = dict(TRAINING_OPTIONS, cache_qat=cache_qat)
    return {k: v for k, v in wanted.items() if k in MODEL_FAMILIES[model_type].options}
