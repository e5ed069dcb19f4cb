"""Counter-based Exp(1) noise for the static drafters' exponential race, one pass.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``slot_noise(keys, positions, vocab) -> noise``: noise[s, v] = −log u, u = ((h >> 8) + ½) · 2⁻²⁴
  with h = fmix32(fmix32(v + φ) ⊕ fmix32(fmix32(keys[s]) ⊕ positions[s])), fmix32 MurmurHash3's
  32-bit finaliser and φ = 0x9E3779B9: a uniform on (0, 1) at 24-bit resolution that depends on
  (key, position, token id) only (`dspark.draft.static_chain` says why the drafters want that).

Shapes: keys, positions LongTensor [S] (32-bit values: `static_chain.noise_key`, positions < 2³¹)
-> noise fp32 [S, V]. Shape symbols: S slots, V vocabulary.

Why fused: the reference builds the hash out of ~18 elementwise torch ops over [S, V] int64 tensors
(S = 64, V = 129280: ~1.8 GB of memory traffic per drafted slot); the kernel computes each entry in
registers with 32-bit integer arithmetic (uint32 products wrap, which is the hash) and writes the
fp32 noise once. The integer hash is bit-exact between the two; −log may differ in the last ulp
(Triton's `log` against torch's), which can move an exponential-race pick only at an exact tie.
No host read: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_BLOCK_V = 1024


def _fmix32_ref(x: torch.Tensor) -> torch.Tensor:
    """fmix32 on int64 tensors holding 32-bit values; int64 products wrap and are masked back, which
    keeps their low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _C2) & _MASK32
    return x ^ (x >> 16)


def _check(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> None:
    if keys.dim() != 1 or positions.shape != keys.shape or keys.dtype != torch.long or positions.dtype != torch.long:
        raise ValueError(f"keys and positions must be LongTensors [S] of one shape, got {keys.dtype} "
                         f"{tuple(keys.shape)} and {positions.dtype} {tuple(positions.shape)}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be an int >= 1, got {vocab!r}")


def slot_noise_ref(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Torch reference of `slot_noise` (module docstring)."""
    _check(keys, positions, vocab)
    salt = _fmix32_ref(_fmix32_ref(keys & _MASK32) ^ (positions & _MASK32))  # [S]
    ids = _fmix32_ref(torch.arange(vocab, device=keys.device) + _GOLDEN)  # [V]
    h = _fmix32_ref(ids[None, :] ^ salt[:, None])  # [S, V]
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


@_jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@_jit
def _slot_noise_kernel(keys_ptr, positions_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    """noise[s, chunk] for row s = program 0 and V chunk = program 1 (uint32 arithmetic throughout)."""
    s = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key = (tl.load(keys_ptr + s) & 0xFFFFFFFF).to(tl.uint32)
    pos = (tl.load(positions_ptr + s) & 0xFFFFFFFF).to(tl.uint32)
    salt = _fmix32(_fmix32(key) ^ pos)
    ids = _fmix32(offs.to(tl.uint32) + 0x9E3779B9)
    h = _fmix32(ids ^ salt)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    tl.store(out_ptr + s.to(tl.int64) * vocab + offs, -tl.log(u), mask=offs < vocab)


def slot_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fused `slot_noise_ref` (same signature): one kernel, grid (S, ceil(V / 1024))."""
    require_triton()
    _check(keys, positions, vocab)
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _slot_noise_kernel[(keys.shape[0], triton.cdiv(vocab, _BLOCK_V))](
            keys.contiguous(), positions.contiguous(), out, vocab, BLOCK_V=_BLOCK_V)
    return out
