"""DeepSeek-V4.1 checkpoints in the official layout: what each key looks like on disk, reading, writing.

Parameter names are the official keys (bare `layers.N...`, `embed.weight`, `head.weight`, no
`model.` prefix; deepseek_v41 spec §11.1), so loading is the generic loop of :mod:`dspark.loader`
plus the knowledge kept here (spec §11.2):

=====================================================  =========  ===============================
keys                                                   on disk    scale
=====================================================  =========  ===============================
attn.{wq_a, wq_b, wkv, wo_a, wo_b}, attn.indexer.wq_b,  FP8 e4m3   UE8M0 per 32 × 32 block (MXFP8)
shared_experts.w{1,2,3}, engram.wkv
ffn.experts.E.w{1,2,3}                                 FP4 e2m1   UE8M0 per 1 × 32 (packed in I8)
engram.embed (the hash tables)                         FP8 e4m3   UE8M0 per 1 × 32 (row chunks)
attn_sink, gate.bias, gate.bias_vl, hc_*               F32        —
everything else (embed, head, norms, compressor,       BF16       —
indexer wk / weights_proj, gate.weight, q/k_weight)
=====================================================  =========  ===============================

Ignored on load (:data:`IGNORED_KEYS`): the DSpark stages `mtp.*` (the drafter reads them:
`dspark.draft.io.dspark_from_v41_checkpoint`, same formats as the layers), the
vision tower `vision.*`, `aligner.*` and the image delimiter embeddings. `load_checkpoint` also
binds the directory's `tokenizer.json` to the Engram hashing (spec §8.1); without one the model
keeps the identity compressed-id table.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dspark.loader import SafetensorsReader, load_tensors, plan_sources, save_sharded
from dspark.quant import ENGRAM_BLOCK, FP4_BLOCK, V41_DENSE_BLOCK, dequantize, quantize_fp4, quantize_fp8

FP8, FP8_ROWS, FP4, BF16, FP32 = "fp8", "fp8_rows", "fp4", "bf16", "fp32"

# First match wins; keys matching none are BF16 on disk.
DISK_FORMATS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$"), FP4),
    (re.compile(r"\.engram\.embed\.weight$"), FP8_ROWS),
    (re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]|\.engram\.wkv"
                r"|^mtp\.0\.main_proj)\.weight$"), FP8),
    # `hc_*_scale` land here: mHC parameters that merely end in "scale", never block scales.
    (re.compile(r"(\.attn_sink|\.gate\.bias|\.gate\.bias_vl|(^|\.)hc_[a-z]+_[a-z]+)$"), FP32),
)
_DISK_DTYPES = {BF16: torch.bfloat16, FP32: torch.float32}
_BLOCKS = {FP8: V41_DENSE_BLOCK, FP8_ROWS: ENGRAM_BLOCK, FP4: FP4_BLOCK}

IGNORED_KEYS: tuple[re.Pattern, ...] = (
    re.compile(r"^mtp\."),
    re.compile(r"^(vision|aligner)\."),
    re.compile(r"^image_(start|end|newline)$"),
)

DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": list(V41_DENSE_BLOCK),
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


def disk_format(name: str) -> str:
    """On-disk format of official key `name`: fp8 / fp8_rows / fp4 / bf16 / fp32."""
    return next((fmt for pattern, fmt in DISK_FORMATS if pattern.search(name)), BF16)


def official_name(key: str) -> str | None:
    """Model name of on-disk `key`; None for a deliberately ignored key."""
    return None if any(pattern.search(key) for pattern in IGNORED_KEYS) else key


def load_checkpoint(model: torch.nn.Module, path: str | Path, config: dict) -> None:
    """Load checkpoint directory `path` into `model` and bind its tokenizer to the Engram hashing.

    `config` is the directory's `config.json` (its `weight_block_size` is the dense FP8 block;
    Engram tables always use 1 × 32). Raises ValueError naming every missing, unexpected or
    mis-shaped key, and when the tokenizer's compressed vocabulary does not match the config.
    """
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    dense = tuple(quant.get("weight_block_size", V41_DENSE_BLOCK))

    def fp8_block(key: str) -> tuple[int, int]:
        return ENGRAM_BLOCK if disk_format(key) == FP8_ROWS else dense

    with SafetensorsReader(path) as reader:
        sources, problems = plan_sources(reader, official_name, fp8_block, FP4_BLOCK)
        load_tensors(model.state_dict(keep_vars=True), sources, problems=problems, where=str(path))
    tokenizer_file = Path(path) / "tokenizer.json"
    if tokenizer_file.is_file() and model.engram_ids:
        from tokenizers import Tokenizer  # only needed for Engram models with a tokenizer

        model.bind_tokenizer(Tokenizer.from_file(str(tokenizer_file)))


def encode_tensor(name: str, tensor: torch.Tensor, quantize: bool = True) -> dict[str, torch.Tensor]:
    """On-disk tensors for official key `name`: `{name: weight}` plus `{*.scale}` when quantised;
    with `quantize=False` the tensor is stored as the model holds it (lossless)."""
    tensor = tensor.detach()
    fmt = disk_format(name)
    if not quantize:
        encoded = {name: tensor}
    elif fmt in _BLOCKS:
        weight, scale = (quantize_fp4 if fmt == FP4 else quantize_fp8)(tensor, _BLOCKS[fmt])
        encoded = {name: weight, name.removesuffix("weight") + "scale": scale}
    else:
        encoded = {name: tensor.to(_DISK_DTYPES[fmt])}
    return {key: value.cpu().contiguous() for key, value in encoded.items()}


def decode_tensor(name: str, encoded: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`: the value the model gets back, in `dtype`."""
    weight = encoded[name]
    fmt = disk_format(name)
    scale = encoded.get(name.removesuffix("weight") + "scale") if fmt in _BLOCKS else None
    if scale is None:
        return weight.to(dtype)
    return dequantize(weight, scale, _BLOCKS[fmt] if fmt != FP4 else V41_DENSE_BLOCK, FP4_BLOCK, dtype)


@torch.no_grad()
def round_to_checkpoint_(model: torch.nn.Module) -> torch.nn.Module:
    """Round every tensor of `model` in place to what a quantised checkpoint stores, so that
    `save_checkpoint(model, quantize=True)` followed by loading is exact."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        tensor.copy_(decode_tensor(name, encode_tensor(name, tensor), tensor.dtype))
    return model


def checkpoint_config(model: torch.nn.Module, quantize: bool) -> dict:
    """The released composite `config.json`, with the official `quantization_config` when
    quantised; `torch_dtype` is bfloat16 then, the model's dtype otherwise."""
    config = model.config.to_dict()
    config["quantization_config"] = dict(QUANTIZATION_CONFIG) if quantize else None
    config["torch_dtype"] = "bfloat16" if quantize else str(model.dtype).removeprefix("torch.")
    return config


def save_checkpoint(model: torch.nn.Module, path: str | Path, quantize: bool = True,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write `model` to directory `path` in the official layout (sharded safetensors, index,
    `config.json`). With `quantize=True` every key gets its released format (module table);
    with `quantize=False` tensors keep the model's dtypes."""
    save_sharded(path, model.state_dict(), lambda name, tensor: encode_tensor(name, tensor, quantize),
                 checkpoint_config(model, quantize), max_shard_bytes)
