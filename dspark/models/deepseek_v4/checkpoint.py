"""DeepSeek-V4 checkpoints: what each official key looks like on disk, reading and writing.

Our parameter names are the official checkpoint keys (docs/design.md), so loading the official
release is the generic loop of :mod:`dspark.loader` plus the knowledge kept here:

* :data:`DISK_FORMATS`: which keys are FP8 (128 x 128 UE8M0 blocks), packed FP4 (1 x 32), BF16,
  FP32 or int64 on disk (deepseek_v4 spec §13.2);
* :data:`IGNORED_KEYS`: keys some exports carry that the model deliberately does not use;
* the three layouts :func:`load_checkpoint` reads, told apart by their key names:

  ``official``  official names (no ``model.`` prefix), quantised or not. This is the released
                checkpoint and what :func:`save_checkpoint` writes, with ``quantize`` either way.
  ``hf``        transformers' in-memory names (``model.layers.0.self_attn.q_a_proj.weight``,
                ``lm_head.weight``, merged experts), e.g. ``save_pretrained(...,
                save_original_format=False)``; translated by :mod:`.hf_keys`.
  ``hf_saved``  transformers' default ``save_pretrained``: official names again, but under a
                ``model.`` prefix and with a few names HF's reverse renaming cannot restore.

The MTP rule: transformers drops ``mtp.*``. When a checkpoint has no ``mtp.*`` key at all, the MTP
block keeps its random initialisation and ``model.has_mtp`` is False; when it has some, all of
them must be present. A DSpark checkpoint (:func:`holds_dspark_stages`) stores the DSpark drafter's
stages under ``mtp.*`` instead: the target leaves them to ``dspark.draft.io``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from dspark.loader import SafetensorsReader, load_tensors, plan_sources, save_sharded, sources_from_tensors
from dspark.models.deepseek_v4 import hf_keys
from dspark.quant import FP4_BLOCK, V4_DENSE_BLOCK, dequantize, quantize_fp4, quantize_fp8

FP8, FP4, BF16, FP32, INT64 = "fp8", "fp4", "bf16", "fp32", "int64"

# First match wins; keys matching none are BF16 on disk: embed, head, every norm, compressor and
# indexer-compressor wkv/wgate, indexer.weights_proj and the router's gate.weight.
DISK_FORMATS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$"), FP4),
    (re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123])\.weight$"), FP8),
    (re.compile(r"^mtp\.\d+\.(e_proj|h_proj|main_proj)\.weight$"), FP8),
    # `hc_*_scale` land here: mHC parameters that merely end in "scale", never block scales.
    (re.compile(r"(\.attn_sink|\.ape|\.gate\.bias|(^|\.)hc_[a-z]+_[a-z]+)$"), FP32),
    (re.compile(r"\.ffn\.gate\.tid2eid$"), INT64),
)
_DISK_DTYPES = {BF16: torch.bfloat16, FP32: torch.float32, INT64: torch.int64}

# Copies of the shared embedding and head that some exports store inside the MTP block
# (sglang skips them too); the MTP block reuses the main model's.
IGNORED_KEYS: tuple[re.Pattern, ...] = (
    re.compile(r"^mtp\.\d+\.emb\.tok_emb\.weight$"),
    re.compile(r"^mtp\.\d+\.head\.weight$"),
)

# transformers' default save_pretrained output -> official names. HF applies its load-time
# renames in reverse; these are the places where that does not give the official name back.
_HF_SAVED_RENAMES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    # HF's `attn.kv_norm` is renamed `.norm.` -> `.kv_norm.` on load, so it is saved as `attn.norm`.
    (re.compile(r"^(model\.layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
    (re.compile(r"^model\."), ""),
)

DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": list(V4_DENSE_BLOCK),
}


def disk_format(name: str) -> str:
    """On-disk format of official key ``name`` in the released layout: fp8/fp4/bf16/fp32/int64."""
    return next((fmt for pattern, fmt in DISK_FORMATS if pattern.search(name)), BF16)


def is_ignored(key: str) -> bool:
    return any(pattern.match(key) for pattern in IGNORED_KEYS)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def detect_layout(keys: Iterable[str]) -> str:
    """``"official"``, ``"hf"`` or ``"hf_saved"`` (see the module docstring), from key names."""
    keys = list(keys)
    if not any(key.startswith("model.") for key in keys):
        return "official"
    hf_only = (".self_attn.", ".mlp.", ".input_layernorm.")
    if "lm_head.weight" in keys or any(marker in key for key in keys for marker in hf_only):
        return "hf"
    return "hf_saved"


def official_name(key: str, layout: str) -> str | None:
    """Official name of on-disk ``key`` in an ``official`` / ``hf_saved`` layout; None if ignored."""
    if layout == "hf_saved":
        for pattern, replacement in _HF_SAVED_RENAMES:
            key = pattern.sub(replacement, key)
    return None if is_ignored(key) else key


def _sources(reader: SafetensorsReader, layout: str, fp8_block: tuple[int, int]):
    if layout == "hf":
        # HF merges experts across keys, so this layout is translated as a whole state dict.
        official = hf_keys.hf_to_official({key: reader.get(key) for key in reader.keys()})
        return sources_from_tensors(official), {}
    return plan_sources(reader, lambda key: official_name(key, layout), fp8_block, FP4_BLOCK)


def routing_table_problems(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Hash-routing tables must name K distinct experts in [0, E) per token (spec §13.4 item 5)."""
    problems = []
    for name, table in tensors.items():
        if not name.endswith(".ffn.gate.tid2eid"):
            continue
        n_experts = tensors[name.removesuffix("tid2eid") + "weight"].shape[0]
        if table.numel() and (table.min() < 0 or table.max() >= n_experts):
            problems.append(f"{name}: expert ids outside [0, {n_experts})")
        elif (table.sort(dim=-1).values.diff(dim=-1) == 0).any():
            problems.append(f"{name}: some tokens are routed twice to the same expert")
    return problems


def holds_dspark_stages(config: dict, keys: Iterable[str]) -> bool:
    """True for a DSpark checkpoint: ``dspark_*`` config keys and stage 0's ``mtp.0.main_proj``
    (dspark spec §7.1), whose ``mtp.*`` tensors are the drafter's stages, not an MTP block."""
    return any(key.startswith("dspark_") for key in config) and "mtp.0.main_proj.weight" in set(keys)


def load_checkpoint(model: torch.nn.Module, path: str | Path, config: dict) -> None:
    """Load the weights of checkpoint directory ``path`` into ``model`` (any of the three layouts).

    ``config`` is the directory's ``config.json`` as a dict (for ``weight_block_size``). Sets
    ``model.has_mtp``. Raises ``ValueError`` naming every missing, unexpected or mis-shaped key.
    """
    block = tuple((config.get("quantization_config") or {}).get("weight_block_size", V4_DENSE_BLOCK))
    tensors = model.state_dict(keep_vars=True)
    with SafetensorsReader(path) as reader:
        sources, problems = _sources(reader, detect_layout(reader.keys()), block)
        if holds_dspark_stages(config, sources):
            sources = {name: src for name, src in sources.items() if not name.startswith("mtp.")}
            problems = {name: msg for name, msg in problems.items() if not name.startswith("mtp.")}
        has_mtp = any(name.startswith("mtp.") for name in sources)
        if not has_mtp and any(name.startswith("mtp.") for name in tensors):
            # The MTP block stays as initialised: make that a seeded init, not whatever memory held.
            model.init_weights(seed=0)
        load_tensors(tensors, sources, lambda name: not has_mtp and name.startswith("mtp."), problems, str(path))
    problems = routing_table_problems(tensors)
    if problems:
        raise ValueError(f"cannot load {path}:\n  " + "\n  ".join(problems))
    model.has_mtp = has_mtp


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def encode_tensor(name: str, tensor: torch.Tensor, quantize: bool = True) -> dict[str, torch.Tensor]:
    """On-disk tensors for official key ``name``: ``{name: weight}`` plus ``{*.scale}`` if quantised.

    With ``quantize=False`` the tensor is stored as it is in the model (lossless). Quantisation
    runs where the tensor lives (a GPU-resident model quantises on the GPU); results come back
    to the CPU for writing.
    """
    tensor = tensor.detach()
    fmt = disk_format(name)
    if not quantize:
        encoded = {name: tensor}
    elif fmt in (FP8, FP4):
        weight, scale = quantize_fp8(tensor, V4_DENSE_BLOCK) if fmt == FP8 else quantize_fp4(tensor, FP4_BLOCK)
        encoded = {name: weight, name.removesuffix("weight") + "scale": scale}
    else:
        encoded = {name: tensor.to(_DISK_DTYPES[fmt])}
    return {key: value.cpu().contiguous() for key, value in encoded.items()}


def decode_tensor(name: str, encoded: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`: the value the model gets back, in ``dtype``."""
    weight = encoded[name]
    scale = encoded.get(name.removesuffix("weight") + "scale") if name.endswith(".weight") else None
    return weight.to(dtype) if scale is None else dequantize(weight, scale, V4_DENSE_BLOCK, FP4_BLOCK, dtype)


def round_to_checkpoint_(model: torch.nn.Module) -> torch.nn.Module:
    """Round every tensor of ``model`` in place to what a quantised checkpoint stores.

    Afterwards ``save_checkpoint(model, quantize=True)`` followed by loading is exact.
    """
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            tensor.copy_(decode_tensor(name, encode_tensor(name, tensor), tensor.dtype))
    return model


def checkpoint_config(model: torch.nn.Module, quantize: bool) -> dict:
    """``config.json`` contents: the model's config, plus the official ``quantization_config`` and
    top-level ``expert_dtype`` when quantised; ``torch_dtype`` is the dtype of the unquantised
    weights (bfloat16 in the release, the model's dtype otherwise)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("quantization_config", "expert_dtype")}
    config["model_type"] = "deepseek_v4"
    if quantize:
        config.update(quantization_config=dict(QUANTIZATION_CONFIG), expert_dtype="fp4", torch_dtype="bfloat16")
    else:
        config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    return config


def save_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    quantize: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``model`` to directory ``path`` in the official layout.

    Files: ``config.json``, ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``. With ``quantize=True`` each key gets its released format
    (:data:`DISK_FORMATS`: FP8 e4m3 with 128 x 128 UE8M0 scales for dense linears, packed FP4 with
    1 x 32 scales for routed experts, BF16 / FP32 / int64 for the rest); with ``quantize=False``
    tensors keep the model's dtypes. An MTP block that was never loaded (``model.has_mtp`` False)
    is not written, so it is not mistaken for trained weights later.
    """
    state = model.state_dict()
    if not getattr(model, "has_mtp", True):
        state = {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}
    save_sharded(path, state, lambda name, tensor: encode_tensor(name, tensor, quantize),
                 checkpoint_config(model, quantize), max_shard_bytes)
