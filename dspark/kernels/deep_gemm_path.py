"""Optional FP8 GEMMs on DeepSeek's DeepGEMM (`deep_gemm`): capability check, layouts, dense linear.

DeepGEMM's Hopper kernels multiply two FP8 e4m3 operands, each with its own fp32 block scales:

    d [M, N] bf16 = (A · sfa) @ (B · sfb)ᵀ,   fp32 accumulation, one bf16 rounding at the end

* A [M, K] e4m3, K-major (row-major); sfa [M, ⌈K/128⌉] fp32, one scale per token per 128 columns,
  passed **MN-major and TMA-aligned**: element (m, j) at offset m + j·align(M, 4) (TMA needs 16-byte
  aligned column starts). The library transposes any other layout itself, at the cost of a kernel.
* B [N, K] e4m3 row-major; sfb [⌈N/128⌉, ⌈K/128⌉] fp32 row-major: 128×128 blocks, V4's dense layout.
* K a multiple of 128 and N of 64 (asserted by the older releases; the TMA layouts need the same).

Entry points, current release → older release (the call contract is the same):
``fp8_gemm_nt`` → ``gemm_fp8_fp8_bf16_nt``; ``m_grouped_fp8_gemm_nt_contiguous`` →
``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous`` (used by `moe_deep_gemm.py`);
``get_mk_alignment_for_contiguous_layout`` → ``get_m_alignment_for_contiguous_layout`` (128 on
Hopper). On Blackwell (sm_100) the library wants the scales as packed UE8M0 bytes instead; this path
enables Hopper (compute capability 9.x) only. Every scale made here is a power of two (UE8M0-exact), so
that packing would lose nothing.

**Numerics: W8A8, not our FP8 path.** dspark's FP8 path is weights-only: FP8BlockWeight tiles are
dequantised in registers and multiplied with bf16 activations (or the model holds dequantised bf16
weights). This path also quantises the *activations*: each token's row, per 128 columns, to e4m3 with
the power-of-two scale 2^⌈log2(max(amax, 1e-4)/448)⌉ (`quant.quantize_fp8_exponent` with DeepSeek's
activation floor `quant.ACTIVATION_AMAX_FLOOR`, block 1×128, as `moe_w8a8.py` quantises). That is a
relative error of up to 2^-4 per activation element (e4m3 keeps 3 mantissa bits; elements far below
their block's max lose more, down to the subnormal step), on top of the bf16 path's rounding, and the
output is rounded to bf16 once. Weights lose nothing when they come from a V4 FP8 checkpoint (128×128
power-of-two blocks re-quantise to the same values); dense bf16 weights are quantised to e4m3 as well.
Results therefore differ from the `"ref"` / `"triton"` ops by fp8 quantisation error, not by
rounding: the path is opt-in (``KernelConfig(linear="deep_gemm")``), never a default.

Fallback: the registry op `DeepGemmLinear` checks once per device (`available`) and per call
(shapes, autograd) and, where deep_gemm cannot run, calls the op the device would otherwise use
(Triton on CUDA with Triton, else the torch reference) bit for bit, recording why in
`fallback_reason` and warning once per reason. `w8a8_linear_ref` is the torch reference of the
W8A8 GEMM itself.

Shape symbols: M rows (tokens), K in-features, N out-features, Kb = K/128, Nb = ⌈N/128⌉.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from dspark import quant
from dspark.kernels.autograd import records_grad
from dspark.kernels.fp8 import FP8BlockWeight
from dspark.kernels.linear import _check_args as check_linear_args
from dspark.kernels.registry import triton_available

BLOCK = 128  # DeepGEMM's scale granularity on Hopper: 1×128 for activations, 128×128 for weights
N_MULTIPLE = 64  # N (out-features) granularity of the older releases' kernels
TMA_ALIGN_BYTES = 16
# (current release, older release) names of the GEMM entry points used here. The current names came
# with the July 2025 refactor; every release carrying them skips -1 rows of a contiguous layout.
_NAMES = {
    "gemm_nt": ("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt"),
    "grouped_contiguous": ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"),
}
_ALIGNMENT_NAMES = ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout")

# ----------------------------------------------------------------------------- capability check


@dataclass(frozen=True)
class DeepGemmApi:
    """The deep_gemm entry points this path calls, resolved from the imported module.

    `legacy`: the older release, whose contiguous grouped GEMM reads a group id from every
    alignment block (no -1 blocks; see `moe_deep_gemm.grouped_layout`).
    """

    gemm_nt: Callable
    grouped_contiguous: Callable
    alignment: Callable[[], int]
    legacy: bool
    version: str


def load_api() -> DeepGemmApi | str:
    """Import deep_gemm and resolve its entry points: the API, or why it cannot be used.

    Importing deep_gemm initialises its JIT (it looks for CUDA and nvcc), so any exception, not only
    ImportError, means "unavailable".
    """
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as error:  # noqa: BLE001 (any failure of an optional import is a fallback reason)
        return f"deep_gemm does not import ({type(error).__name__}: {error})"
    alignment = next((getattr(module, n) for n in _ALIGNMENT_NAMES if callable(getattr(module, n, None))), None)
    version = str(getattr(module, "__version__", "unknown"))
    for legacy in (False, True):
        funcs = {key: getattr(module, pair[int(legacy)], None) for key, pair in _NAMES.items()}
        if alignment is not None and all(callable(f) for f in funcs.values()):
            return DeepGemmApi(**funcs, alignment=alignment, legacy=legacy, version=version)
    wanted = [pair[0] for pair in _NAMES.values()] + [_ALIGNMENT_NAMES[0]]
    missing = [name for name in wanted if not callable(getattr(module, name, None))]
    return f"deep_gemm {version} lacks {missing} (and their older names)"


def device_reason(device: torch.device) -> str | None:
    """Why deep_gemm's Hopper kernels cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return f"deep_gemm runs on CUDA devices, got {device}"
    if not torch.cuda.is_available():
        return "deep_gemm needs CUDA, and torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"this deep_gemm path targets compute capability 9.x (Hopper), got {major}.{minor}"
    return None


def available(device: torch.device | str) -> tuple[bool, str]:
    """(whether deep_gemm can run on `device`, the reason or what was found).

    Checks, in order: deep_gemm imports, its entry points are present (current or older names),
    `device` is a CUDA device of compute capability 9.x.
    """
    api = load_api()
    if isinstance(api, str):
        return False, api
    reason = device_reason(torch.device(device))
    if reason is not None:
        return False, reason
    return True, f"deep_gemm {api.version} ({'older' if api.legacy else 'current'} API)"


# ----------------------------------------------------------------------------------- layouts


def tma_aligned_size(mn: int, element_size: int = 4) -> int:
    """MN rounded up so that a column of a MN-major scale tensor starts on a 16-byte boundary."""
    step = TMA_ALIGN_BYTES // element_size
    return -(-mn // step) * step


def mn_major_tma_aligned(sf: torch.Tensor) -> torch.Tensor:
    """The same fp32 scales [..., MN, Kb] stored MN-major with TMA-aligned columns.

    Strides (..., 1, align(MN, 4)), and align(MN, 4)·Kb between groups: the layout deep_gemm takes
    without transposing it again. The padding rows are zeros and never read as results.
    """
    *lead, mn, kb = sf.shape
    padded = tma_aligned_size(mn, sf.element_size())
    storage = sf.new_zeros(*lead, kb, padded)  # [..., Kb, MN_pad]
    storage[..., :mn] = sf.transpose(-1, -2)
    return storage[..., :mn].transpose(-1, -2)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 of x [M, K] (K a multiple of 128): q [M, K] e4m3 and sf [M, Kb] fp32 powers of
    two, row-major (one block of 1×128 each, its max floored at `quant.ACTIVATION_AMAX_FLOOR`; no
    host sync)."""
    q, exponent = quant.quantize_fp8_exponent(x, (1, BLOCK), amax_floor=quant.ACTIVATION_AMAX_FLOOR)
    return q, torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)


def dequantize_rows(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """x̂ [M, K] fp32 = q · sf per 1×128 block (`quantize_rows`' pair): the activation deep_gemm multiplies."""
    return quant.dequantize_fp8(q, sf, (1, BLOCK))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (A [M, K] e4m3 contiguous, sfa [M, Kb] fp32 MN-major TMA-aligned): deep_gemm's LHS."""
    q, sf = quantize_rows(x)
    return q, mn_major_tma_aligned(sf)


@dataclass(frozen=True)
class DeepGemmWeight:
    """A weight as deep_gemm's RHS: data [..., N, K] e4m3 contiguous, scale [..., Nb, Kb] fp32
    contiguous (128×128 blocks). Built once per weight (`from_weight`) and cached by the op."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def from_weight(cls, weight: torch.Tensor | FP8BlockWeight) -> DeepGemmWeight:
        """From an FP8BlockWeight with 128×128 blocks (bytes kept, scales decoded to fp32) or a dense
        [..., N, K] tensor (quantised with 128×128 power-of-two blocks: exact for the dequantised
        weights of a V4 FP8 checkpoint). ValueError for any other block size."""
        if not isinstance(weight, FP8BlockWeight):
            weight = FP8BlockWeight.quantize(weight.detach(), BLOCK)
        if weight.block != BLOCK:
            raise ValueError(f"deep_gemm takes 128x128 weight blocks, got block {weight.block}")
        return cls(weight.data.contiguous(), quant.scale_to_float(weight.scale).contiguous())

    def dequantize(self) -> torch.Tensor:
        """fp32 [..., N, K] (what deep_gemm multiplies by)."""
        return quant.dequantize_fp8(self.data, self.scale, (BLOCK, BLOCK))


def gemm_shape_reason(n_out: int, n_in: int) -> str | None:
    """Why deep_gemm cannot take a [N, K] weight, or None."""
    if n_in % BLOCK or n_out % N_MULTIPLE:
        return f"deep_gemm needs K % {BLOCK} == 0 and N % {N_MULTIPLE} == 0, got weight [N={n_out}, K={n_in}]"
    return None


# ------------------------------------------------------------------------------- dense linear


def w8a8_linear_ref(x: torch.Tensor, weight: DeepGemmWeight) -> torch.Tensor:
    """Torch reference of `fp8_linear`: x [..., K] quantised per token per 128 columns
    (`quantize_rows`), times the dequantised weight [N, K]ᵀ in fp32, rounded to bf16, returned in
    x.dtype [..., N]."""
    xq = dequantize_rows(*quantize_rows(x.reshape(-1, x.shape[-1])))
    y = (xq @ weight.dequantize().T).to(torch.bfloat16)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.data.shape[0])


def fp8_linear(api: DeepGemmApi, x: torch.Tensor, weight: DeepGemmWeight) -> torch.Tensor:
    """y [..., N] = x [..., K] · Wᵀ on deep_gemm (W8A8, bf16 output cast to x.dtype).

    The caller checks the shapes (`gemm_shape_reason`); no host sync.
    """
    n_out, n_in = weight.data.shape
    rows = x.reshape(-1, n_in)
    out = torch.empty((rows.shape[0], n_out), dtype=torch.bfloat16, device=x.device)
    if rows.shape[0]:  # the older release does not return early on M = 0
        api.gemm_nt(quantize_activations(rows), (weight.data, weight.scale), out)
    return out.to(x.dtype).reshape(*x.shape[:-1], n_out)


# ------------------------------------------------------------------------- the registry's ops


def weight_key(t: torch.Tensor | FP8BlockWeight) -> tuple:
    """Identity of a weight's storage and contents: in-place updates (load_state_dict) bump _version."""
    parts = (t.data, t.scale) if isinstance(t, FP8BlockWeight) else (t,)
    return tuple((p.data_ptr(), p._version, tuple(p.shape), p.dtype, p.device) for p in parts)


class DeepGemmOp:
    """Shared bookkeeping of a deep_gemm op: the per-device decision, the fallback op, the reason.

    One instance per `get_op` call (per module); it holds the converted weights of the module that
    owns it, so nothing is shared between models and nothing is global. `fallback_reason` is None
    while deep_gemm runs, else the last reason the fallback ran (also warned, once per reason).
    """

    op_name = ""  # the registry op whose fallback runs ...
    fallback_module = ""  # ... from dspark.kernels.<fallback_module>

    def __init__(self):
        self._decided: dict[torch.device, DeepGemmApi | str] = {}  # device -> api, or why not
        self._weights: dict[tuple, object] = {}  # weight identity -> converted weights
        self._warned: set[str] = set()
        self.fallback_reason: str | None = None

    def _api(self, device: torch.device) -> DeepGemmApi | str:
        if device not in self._decided:
            api = load_api()
            reason = api if isinstance(api, str) else device_reason(device)
            self._decided[device] = api if reason is None else reason
        return self._decided[device]

    def _fall_back(self, reason: str, device: torch.device) -> Callable:
        """Record and warn once per reason; the op the device would run without deep_gemm."""
        self.fallback_reason = reason
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"KernelConfig.{self.op_name}='deep_gemm' falls back: {reason}", RuntimeWarning,
                          stacklevel=3)
        impl = "triton" if device.type == "cuda" and triton_available() else "ref"
        module = importlib.import_module(f"dspark.kernels.{self.fallback_module}")
        return getattr(module, self.op_name if impl == "triton" else f"{self.op_name}_ref")

    def _converted(self, key: tuple, build: Callable[[], object]) -> object:
        """The converted weights for `key`, built on first use (an entry per live weight identity:
        a module's op sees one weight, re-converted when it is modified in place)."""
        if key not in self._weights:
            stale = [k for k in self._weights if [p[0] for p in k] == [p[0] for p in key]]
            for k in stale:  # the same storage with older contents: drop it
                del self._weights[k]
            self._weights[key] = build()
        return self._weights[key]


class DeepGemmLinear(DeepGemmOp):
    """`linear(x, weight)` (same signature as `dspark.kernels.linear.linear`) on deep_gemm's
    `fp8_gemm_nt`, W8A8 (module docstring). The FP8 copy of `weight` is made on first use and kept
    next to it (half the bf16 weight's bytes, plus its scales)."""

    op_name = "linear"
    fallback_module = "linear"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check_linear_args(x, weight)  # bad input raises here, whichever path runs
        api = self._api(x.device)
        reason = api if isinstance(api, str) else self._call_reason(x, weight)
        if reason is not None:
            return self._fall_back(reason, x.device)(x, weight)
        self.fallback_reason = None
        converted = self._converted(weight_key(weight), lambda: DeepGemmWeight.from_weight(weight))
        return fp8_linear(api, x, converted)

    @staticmethod
    def _call_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
        if records_grad(x, weight):
            return "autograd is recording (deep_gemm has no backward)"
        return gemm_shape_reason(*weight.shape)
