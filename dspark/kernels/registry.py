"""Which implementation runs each fused op: chosen from a frozen config, never from the environment.

The model holds a `KernelConfig` (built once at the edge, from the device the model lives on) and asks
`get_op(config, "mhc_pre")` for a callable. Every op has two implementations with one signature:

* ``"ref"``    -- plain torch (`<op>_ref`): runs anywhere, the numerical reference of the tests;
* ``"triton"`` -- the fused Triton kernels (`<op>`): CUDA tensors, or CPU tensors under the Triton
  interpreter in tests;
* ``"flashinfer"`` -- only where an op has one (`FLASHINFER_OPS`): flashinfer's kernels behind the
  same signature, an optional dependency, never a default (chosen explicitly in the config);
* ``"deep_gemm"`` -- only where an op has one (`DEEP_GEMM_OPS`: the linear and the MoE experts):
  DeepGEMM's FP8 GEMMs, W8A8 (activations quantised to e4m3 per token per 128 columns, so results
  differ by fp8 error: `deep_gemm_path`), never a default. Where deep_gemm cannot run (not installed,
  not Hopper, shapes, autograd) the op runs the Triton / torch op instead and says why
  (``op.fallback_reason`` and one warning per reason): selecting it never fails for lack of it.
* ``"w8a8"`` -- only where an op has one (`W8A8_OPS`: the MoE experts): Triton e4m3 × e4m3 GEMMs with
  the activations quantised per token per block as DeepSeek's inference does (`moe_w8a8`), the
  torch form of the same arithmetic off CUDA; fp8 error, not rounding, so never a default.

Triton is an optional dependency (the ``gpu`` extra): importing this package never imports it;
asking for a ``"triton"`` op without it raises an ImportError that says how to install it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

Impl = Literal["ref", "triton", "flashinfer", "deep_gemm", "w8a8"]
IMPLS: tuple[str, ...] = ("ref", "triton", "flashinfer", "deep_gemm", "w8a8")
# op name -> (module under dspark.kernels, callable class): a fresh instance per `get_op`, which holds
# its own flashinfer workspaces (no state shared between models).
FLASHINFER_OPS: dict[str, tuple[str, str]] = {
    "sparse_attention": ("attention_flashinfer", "SparseAttentionFlashinfer"),
}
# op name -> (module, callable class): a fresh instance per `get_op`, which caches the FP8 copies of
# its module's weights and its per-device decision (deep_gemm or the fallback).
DEEP_GEMM_OPS: dict[str, tuple[str, str]] = {
    "linear": ("deep_gemm_path", "DeepGemmLinear"),
    "moe_experts": ("moe_deep_gemm", "DeepGemmMoeExperts"),
}
# op name -> (module, callable class): Triton W8A8 GEMMs (activations quantised as DeepSeek's inference
# does: `moe_w8a8`), a fresh instance per `get_op` that caches its module's FP8 weights.
W8A8_OPS: dict[str, tuple[str, str]] = {
    "moe_experts": ("moe_w8a8", "W8A8MoeExperts"),
}
# The optional backends: impl name -> the ops that have it.
OPTIONAL_BACKENDS: dict[str, dict[str, tuple[str, str]]] = {
    "flashinfer": FLASHINFER_OPS, "deep_gemm": DEEP_GEMM_OPS, "w8a8": W8A8_OPS,
}

# op name -> module under dspark.kernels that defines `<op>` (Triton) and `<op>_ref` (torch).
_OP_MODULES: dict[str, str] = {
    "mhc_pre": "mhc",
    "mhc_post": "mhc",
    "mhc_post_pre": "mhc",
    "mhc_pre_norm": "mhc_norm",
    "mhc_post_pre_norm": "mhc_norm",
    "hc_head_norm": "hc_head_norm",
    "mhc_v41_pre": "mhc_v41",
    "mhc_v41_post_pre": "mhc_v41",
    "moe_route": "moe",
    "moe_route_rows": "moe",
    "fused_moe": "moe",
    "moe_experts": "moe",
    "engram_gate": "engram_gate",
    "engram_rows": "engram_rows",
    "sparse_attention": "attention",
    "sparse_attention_qnorm": "attention",
    "lightning_indexer": "indexer",
    "select_topk": "indexer",
    "index_scores": "indexer",
    "indexer_pool": "indexer_pool",
    "index_scores_pooled": "indexer_pool",
    "compressor_pool": "compressor",
    "compressor_pool_gather": "compressor",
    "grouped_wo_a": "grouped_wo_a",
    "linear": "linear",
    "linear_scaled": "linear",
    "linear_rope": "linear",
    "compressor_project": "linear",
    "compressor_project_fp32": "linear",
    "cache_round": "cache_round",
    "rms_norm": "rms_norm",
    "rope": "rope",
    "norm_rope": "norm_rope",
    "step_index": "step_index",
    "markov_greedy": "markov_greedy",
    "slot_noise": "slot_noise",
}
OPS: tuple[str, ...] = tuple(_OP_MODULES)
# The V4 mHC sites with the sublayer RMSNorm folded in -> the site op they replace (`norm_folded_op`).
NORM_FOLDED: dict[str, str] = {"mhc_pre_norm": "mhc_pre", "mhc_post_pre_norm": "mhc_post_pre"}
# Kernels checked only under the Triton interpreter and by the sm_90 compile test: a model picks them
# with an explicit KernelConfig (e.g. `KernelConfig.for_device("cuda")` replaced with
# grouped_wo_a="triton"), never by default, until a GPU run has compared them with their references.
# Empty since the twenty-ninth session (`moe_route_rows` ran on an H100: bench/gpu_session29.sh a).
NOT_YET_ON_GPU: tuple[str, ...] = ()


@functools.lru_cache(maxsize=None)
def package_available(name: str) -> bool:
    """True when `import name` succeeds (answered once per process and name; it cannot change)."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    """True when `import triton` succeeds."""
    return package_available("triton")


def require_triton() -> None:
    """Raise a clear ImportError when the Triton implementation is asked for without Triton."""
    if not triton_available():
        raise ImportError(
            "the 'triton' kernel implementation needs the triton package: "
            "pip install -e '.[gpu]' (or choose impl 'ref' in KernelConfig)"
        )


@dataclass(frozen=True)
class KernelConfig:
    """Implementation per fused op: ``"ref"`` or ``"triton"``, or an optional backend where the op has
    one (``"flashinfer"``: sparse_attention; ``"deep_gemm"``: linear, moe_experts with fused_moe="triton";
    ``"w8a8"``: moe_experts with fused_moe="triton").

    Build it at the edge with `KernelConfig.for_device(device)` (CUDA with Triton installed ->
    every op ``"triton"``; otherwise ``"ref"``) or explicitly, e.g.
    ``KernelConfig(fused_moe="ref")`` to isolate one op. Validated once; immutable.

    `mhc_pre_norm` / `mhc_post_pre_norm` fold the sublayer's RMSNorm into a V4 mHC site. A model
    runs them only when they are ``"triton"``; at ``"ref"`` it keeps the unfused pair (`mhc_pre` /
    `mhc_post_pre`, then `rms_norm`, each as chosen here), of which their references are the torch form.
    `hc_head_norm` likewise folds the final `norm` into V4's output collapse (`head_norm_op`).
    `index_scores_pooled` folds the candidate pool's block maxima into the V4.1 candidate source's
    batched scores: run only when ``"triton"``; at ``"ref"`` the source keeps `index_scores` then
    `indexer_pool` (each as chosen here).
    """

    mhc_pre: Impl = "ref"
    mhc_post: Impl = "ref"
    mhc_post_pre: Impl = "ref"
    mhc_pre_norm: Impl = "ref"
    mhc_post_pre_norm: Impl = "ref"
    hc_head_norm: Impl = "ref"
    mhc_v41_pre: Impl = "ref"
    mhc_v41_post_pre: Impl = "ref"
    moe_route: Impl = "ref"
    moe_route_rows: Impl = "ref"
    fused_moe: Impl = "ref"
    moe_experts: Impl = "ref"
    engram_gate: Impl = "ref"
    engram_rows: Impl = "ref"
    sparse_attention: Impl = "ref"
    sparse_attention_qnorm: Impl = "ref"
    lightning_indexer: Impl = "ref"
    select_topk: Impl = "ref"
    index_scores: Impl = "ref"
    indexer_pool: Impl = "ref"
    index_scores_pooled: Impl = "ref"
    compressor_pool: Impl = "ref"
    compressor_pool_gather: Impl = "ref"
    grouped_wo_a: Impl = "ref"
    linear: Impl = "ref"
    linear_scaled: Impl = "ref"
    linear_rope: Impl = "ref"
    compressor_project: Impl = "ref"
    compressor_project_fp32: Impl = "ref"
    cache_round: Impl = "ref"
    rms_norm: Impl = "ref"
    rope: Impl = "ref"
    norm_rope: Impl = "ref"
    step_index: Impl = "ref"
    markov_greedy: Impl = "ref"
    slot_noise: Impl = "ref"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value not in IMPLS:
                raise ValueError(f"KernelConfig.{field.name}={value!r}: must be one of {IMPLS}")
            backend_ops = OPTIONAL_BACKENDS.get(value)
            if backend_ops is not None and field.name not in backend_ops:
                raise ValueError(f"KernelConfig.{field.name}={value!r}: no {value} implementation; "
                                 f"ops that have one: {tuple(backend_ops)}")
        if self.moe_experts in OPTIONAL_BACKENDS and self.fused_moe != "triton":
            # The MoE module calls `moe_experts` on its fused path only; elsewhere the choice would be ignored.
            raise ValueError(f"KernelConfig.moe_experts={self.moe_experts!r} needs fused_moe='triton' (the MoE "
                             f"runs moe_experts on its fused path), got fused_moe={self.fused_moe!r}")

    @classmethod
    def uniform(cls, impl: Impl) -> KernelConfig:
        """The same implementation for every op ("ref" or "triton")."""
        return cls(**{op: impl for op in OPS})

    @classmethod
    def for_device(cls, device: torch.device | str) -> KernelConfig:
        """Default for a model on `device`: Triton on CUDA when it is installed, torch otherwise;
        ops in `NOT_YET_ON_GPU` stay on their reference until their kernel has run on a GPU."""
        device = torch.device(device)
        if not (device.type == "cuda" and triton_available()):
            return cls.uniform("ref")
        return dataclasses.replace(cls.uniform("triton"), **{op: "ref" for op in NOT_YET_ON_GPU})


def get_op(config: KernelConfig, name: str) -> Callable[..., Any]:
    """The implementation of op `name` that `config` selects (same signature for both impls).

    Raises ValueError for an unknown op name, ImportError for ``"triton"`` without Triton (a
    ``"flashinfer"`` op raises its ImportError on its first call, where it needs the package; a
    ``"deep_gemm"`` op never does: it falls back, see the module docstring).
    """
    if name not in _OP_MODULES:
        raise ValueError(f"unknown kernel op {name!r}; known ops: {OPS}")
    impl = getattr(config, name)
    if impl in OPTIONAL_BACKENDS:
        module, cls = OPTIONAL_BACKENDS[impl][name]
        return getattr(importlib.import_module(f"dspark.kernels.{module}"), cls)()
    if impl == "triton":
        require_triton()
    module = importlib.import_module(f"dspark.kernels.{_OP_MODULES[name]}")
    return getattr(module, name if impl == "triton" else f"{name}_ref")


def norm_folded_op(config: KernelConfig, name: str) -> Callable[..., Any]:
    """An mHC site followed by its sublayer's RMSNorm, as op `name` of `NORM_FOLDED` is called.

    The op itself when `config` picks its kernel; otherwise (``"ref"``) the unfused pair it folds:
    the site op (`mhc_pre` / `mhc_post_pre`), then `rms_norm` on the site's last output (u), each
    as `config` picks them -- exactly what a model ran before the fold (`rms_norm` as the RMSNorm
    module calls it), so "ref" changes no bit and no kernel choice. The op's `_ref` is this pair's
    torch form. Signature: ``(*site_args, norm_weight, *, norm_eps, mixes_on=None, **site_kwargs) ->
    (*mixes, h)``.
    """
    if name not in NORM_FOLDED:
        raise ValueError(f"{name!r} is not a norm-folded op; those are {tuple(NORM_FOLDED)}")
    if getattr(config, name) != "ref":
        return get_op(config, name)
    site_op, norm_op = get_op(config, NORM_FOLDED[name]), get_op(config, "rms_norm")

    def site_then_norm(*args, norm_eps: float, mixes_on=None, **site_kwargs):
        # the site's mixes may go under `mixes_on` (its Triton epilogue); u and its norm stay on the caller's stream
        *site_args, norm_weight = args
        *mixes, u = site_op(*site_args, mixes_on=mixes_on, **site_kwargs)
        return (*mixes, norm_op(u, norm_weight, eps=norm_eps, out_dtype=u.dtype))

    return site_then_norm


def head_norm_op(config: KernelConfig) -> Callable[..., Any]:
    """V4's output collapse followed by its final RMSNorm, as op `hc_head_norm` is called:
    ``(x, fn, base, scale, norm_weight, *, rms_eps, hc_eps, norm_eps) -> h``.

    The op itself when `config` picks its kernel; otherwise (``"ref"``) the unfused pair it folds:
    the torch `hc_head`, then `rms_norm` as `config` picks it -- what a model ran before the fold,
    bit for bit (`hc_head_norm.hc_head_then`; with `rms_norm` at "ref" it is the op's reference).
    """
    if config.hc_head_norm != "ref":
        return get_op(config, "hc_head_norm")
    return importlib.import_module("dspark.kernels.hc_head_norm").hc_head_then(get_op(config, "rms_norm"))
