"""W8A8 routed experts: `moe_experts` with FP8 activations, the arithmetic of DeepSeek's inference.

The weights-only FP8 path of `moe.py` dequantises each weight tile to bf16 and multiplies it with
bf16 activations. DeepSeek's own inference (deepseek_v4 spec §13.3, V4.1 §11.2) instead quantises
every FP8 GEMM's input too, per token per B columns (B = the weight block: 128 for V4, 32 for V4.1)
to e4m3 with the power-of-two scale 2^⌈log2(max(amax, 1e-4) / 448)⌉, and multiplies e4m3 × e4m3 on
the tensor cores (twice bf16's rate on Hopper). This module is that path for the routed and shared
experts:

1. `act_quant(x, block)`: the routed input x [N, D] -> q [N, D] e4m3, exponent [N, D/B] int32
   (one launch). The MoE layer runs it on a side stream while the router runs (`InputQuant`):
   both read only x.
2. grouped GEMM 1 over the packed per-expert rows (`moe._pack_assignments`): per K step of B,
   acc += (q_x · q_W1ᵀ) · 2^(e_x + e_W) (the block scales applied to the fp32 partial sums, as
   DeepGEMM promotes them), the same for W3, then the clamped SwiGLU and, in the epilogue, h's own
   quantisation per token per B columns: h leaves the kernel as e4m3 + exponents.
3. grouped GEMM 2: h·W2ᵀ the same way, fp32 rows; the shared expert through both kernels with the
   identity row map; `moe.launch_finalize` sums y = shared + Σ_k w_k · row.

Ops (same signature as `moe.moe_experts`; weights are `FP8BlockWeight` with one block size for all
six, or dense tensors, quantised here with V4's 128×128 blocks):

* ``moe_experts_w8a8`` (Triton) and ``moe_experts_w8a8_ref`` (torch: activations quantised and
  dequantised exactly, fp32 GEMMs on the dequantised weights); both take ``x_fp8``, x's
  `act_quant` made earlier by the caller. The two differ by fp32 summation
  order, which can move an element of h across an e4m3 rounding boundary now and then.
* ``act_quant`` / ``act_quant_ref``: bit-equal (the exponent is read from the fp32 bits, no log2).

Measured (`bench/moe_w8a8.py`, V4-Flash layer with its router, one H100 and one H200): with 128×128
blocks 1.9–2.2× the weights-only path at 4096–8192 tokens (439 TFLOP/s on the H200, a fifth of fp8
peak: each K step's dot waits for its scaling), 1.1–1.5× at 256–1024; with 32×32 blocks 1.02–1.04× at
4096–8192 and slower below; the side stream 0.97–1.01× the in-line quantisation (it costs nothing,
and hides nothing measurable: `act_quant` is 6–43 µs of a 1.6–16 ms layer).

Numerics against `moe.moe_experts`: the activations lose up to 2^-4 relative per element (e4m3's
three mantissa bits), so results differ by fp8 quantisation error, not rounding. The path is opt-in
(``KernelConfig(moe_experts="w8a8")``, `W8A8MoeExperts`), never a default.

Shape symbols: N tokens, D hidden, E routed experts, K = top_k, I expert width (I_s shared),
R packed rows, B the FP8 block (activation groups of B columns; D, I, I_s multiples of B).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark import quant
from dspark.kernels.autograd import records_grad
from dspark.kernels.aside import Aside, join
from dspark.kernels.deep_gemm_path import weight_key
from dspark.kernels.fp8 import FP8BlockWeight
from dspark.kernels.moe import (
    _check_expert_args, _check_routing_args, _clamped_swiglu, _gemm_rows, _pack_assignments, launch_finalize,
)
from dspark.kernels.registry import require_triton, triton_available
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

DENSE_BLOCK = 128  # block of dense weights quantised here (V4's layout: exact for V4 FP8 checkpoints)
BLOCKS = (32, 64, 128)  # FP8 blocks the kernels take: the K step of an e4m3 dot is >= 32 on Hopper


# ------------------------------------------------------------------------------------- arguments


def fp8_weights(*weights) -> tuple[list[FP8BlockWeight], int]:
    """The six expert weights as FP8BlockWeight (dense ones quantised with DENSE_BLOCK blocks) and
    their common block; ValueError when FP8 weights mix blocks or use one the kernels do not take."""
    out = [w if isinstance(w, FP8BlockWeight) else FP8BlockWeight.quantize(w.detach(), DENSE_BLOCK)
           for w in weights]
    blocks = sorted({w.block for w in out})
    if len(blocks) != 1:
        raise ValueError(f"W8A8 experts need one FP8 block for all weights, got blocks {blocks}")
    if blocks[0] not in BLOCKS:
        raise ValueError(f"W8A8 experts take FP8 blocks {BLOCKS}, got {blocks[0]}")
    return out, blocks[0]


def _check_w8a8_args(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    n_exp = w1.shape[0]
    _check_routing_args(x, weights, ids, n_exp)
    _check_expert_args(x, n_exp, w1, w2, w3, shared_w1, shared_w2, shared_w3)


def _check_groups(block: int, **sizes: int) -> None:
    for name, size in sizes.items():
        if size % block:
            raise ValueError(f"W8A8 experts quantise per {block} columns: {name} must be a multiple of "
                             f"{block}, got {name}={size}")


# ------------------------------------------------------------------------------------ references


def act_quant_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] (D a multiple of block) -> q [M, D] e4m3, exponent [M, D/block] int32: per row per
    `block` columns, scale 2^⌈log2(max(amax, 1e-4) / 448)⌉ (quant.ACTIVATION_AMAX_FLOOR)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, D], got shape {tuple(x.shape)}")
    _check_groups(block, D=x.shape[1])
    return quant.quantize_fp8_exponent(x, (1, block), amax_floor=quant.ACTIVATION_AMAX_FLOOR)


def _act_dequant(q: torch.Tensor, exponent: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 [M, D] = q · 2^exponent per row per block columns (exact)."""
    return torch.ldexp(q.float(), exponent.repeat_interleave(block, dim=1))


def _expert_w8a8_ref(a, w1, w2, w3, block, limit):
    """One clamped SwiGLU expert with W8A8 GEMMs, fp32: a [T, D] (the input, quantised and
    dequantised already) -> [T, D]."""
    gate, up = a @ w1.T, a @ w3.T
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return _act_dequant(*act_quant_ref(F.silu(gate) * up, block), block) @ w2.T


def moe_experts_w8a8_ref(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *,
                         swiglu_limit: float, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                         x_ready: bool = False) -> torch.Tensor:
    """`moe.moe_experts_ref` with every GEMM input quantised per token per B columns (module
    docstring): fp32 math on the exactly dequantised operands, loop over experts. Same shapes.
    `x_fp8`: x's (q, exponent) given by the caller (`act_quant_ref(x, B)` otherwise; the
    quantisation is per row, so each expert's rows of it are its input's). `x_ready` (`moe.moe_experts`'
    launch-order promise) is not used."""
    _check_w8a8_args(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3)
    (w1, w2, w3, sw1, sw2, sw3), block = fp8_weights(w1, w2, w3, shared_w1, shared_w2, shared_w3)
    _check_groups(block, D=x.shape[1], I=w1.shape[1], I_s=sw1.shape[0])
    a = _act_dequant(*(act_quant_ref(x, block) if x_fp8 is None else x_fp8), block)
    y = _expert_w8a8_ref(a, sw1.dequantize(), sw2.dequantize(), sw3.dequantize(), block, swiglu_limit)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        out = _expert_w8a8_ref(a[tok], w1.dequantize(e), w2.dequantize(e), w3.dequantize(e), block, swiglu_limit)
        y.index_add_(0, tok, weights[tok, slot, None].float() * out)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _pow2(exponent):
    """2^exponent as fp32 for int32 exponents in [-126, 127], exact (built from the bits)."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@_jit
def _quant_groups(v, GROUP: tl.constexpr):
    """v [M, C] fp32 (C a multiple of GROUP) -> (q [M, C] e4m3, exponent [M, C / GROUP] int32).

    The exponent ⌈log2(max(amax, 1e-4) / 448)⌉ comes from amax's bits: with amax = 1.f · 2^a and
    448 = 1.75 · 2^8 it is a − 8, plus one when the fraction f exceeds 0.75 (bits 0x600000). That
    equals the torch reference's fp32 division and frexp: the rounded quotient never lands on a power
    of two from above."""
    M: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    g = tl.reshape(v, (M, C // GROUP, GROUP))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    q = tl.reshape(g * _pow2(-exponent)[:, :, None], (M, C)).to(tl.float8e4nv)  # |.| <= 448: no overflow
    return q, exponent


@_jit
def _act_quant_kernel(x_ptr, q_ptr, e_ptr, n_rows, dim,
                      GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """q, exponent of a [BLOCK_R, BLOCK_C] tile of x (BLOCK_C a multiple of GROUP)."""
    pdl_prologue(PDL)
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < n_rows)[:, None] & (offs_c < dim)[None, :]
    v = tl.load(x_ptr + offs_r[:, None] * dim + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    q, exponent = _quant_groups(v, GROUP)
    tl.store(q_ptr + offs_r[:, None] * dim + offs_c[None, :], q, mask=mask)
    groups = dim // GROUP
    offs_g = tl.program_id(1) * (BLOCK_C // GROUP) + tl.arange(0, BLOCK_C // GROUP)
    tl.store(e_ptr + offs_r[:, None] * groups + offs_g[None, :], exponent,
             mask=(offs_r < n_rows)[:, None] & (offs_g < groups)[None, :])


@_jit
def _act_tile(q_ptr, e_ptr, rows, mask, k0, width, SB: tl.constexpr):
    """(a [M, SB] e4m3, its scale [M] fp32) of quantised activation rows `rows` [M] (width columns,
    one exponent per SB of them) at columns k0..k0+SB; rows outside `mask` read zeros."""
    offs_k = k0 + tl.arange(0, SB)
    a = tl.load(q_ptr + rows[:, None] * width + offs_k[None, :], mask=mask[:, None], other=0.0)
    return a, _pow2(tl.load(e_ptr + rows * (width // SB) + k0 // SB, mask=mask, other=0))


@_jit
def _w8a8_step(acc, a, a_scale, w_ptr, s_ptr, e, offs_n, offs_k, k0, n_out, n_in, SB: tl.constexpr):
    """acc + (a · W[e, offs_n, offs_k]ᵀ) · a_scale ⊗ w_scale for one K step inside one scale block:
    a [M, SB] e4m3, a_scale [M] fp32, the weight tile e4m3 with one UE8M0 byte per row."""
    n_mask = offs_n < n_out
    w = tl.load(w_ptr + e * n_out * n_in + offs_n[:, None] * n_in + offs_k[None, :],
                mask=n_mask[:, None] & (offs_k[None, :] < n_in), other=0.0)
    s_rows = tl.cdiv(n_out, SB)
    byte = tl.load(s_ptr + (e * s_rows + offs_n // SB) * (n_in // SB) + k0 // SB, mask=n_mask, other=127)
    w_scale = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127)
    return acc + tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])


@_jit
def _w8a8_up_kernel(
    xq_ptr, xe_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, rows_ptr, block_expert_ptr, hq_ptr, he_ptr,
    n_rows, dim, inter, n_exp, top_k, limit,
    ROUTED: tl.constexpr, SB: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """h = silu(min(x·W1ᵀ, L)) · clamp(x·W3ᵀ, −L, L) for one [BLOCK_M, BLOCK_N] tile, stored as
    e4m3 + one exponent per SB columns (BLOCK_N a multiple of SB)."""
    pdl_prologue(PDL)
    e, rows, in_rows, in_mask, out_mask = _gemm_rows(tl.program_id(0), block_expert_ptr, rows_ptr, n_rows,
                                                     n_exp, top_k, ROUTED, True, BLOCK_M)
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, dim, SB):
        offs_k = k0 + tl.arange(0, SB)
        a, a_scale = _act_tile(xq_ptr, xe_ptr, in_rows, in_mask, k0, dim, SB)
        acc_g = _w8a8_step(acc_g, a, a_scale, w1_ptr, s1_ptr, e, offs_n, offs_k, k0, inter, dim, SB)
        acc_u = _w8a8_step(acc_u, a, a_scale, w3_ptr, s3_ptr, e, offs_n, offs_k, k0, inter, dim, SB)
    hq, he = _quant_groups(_clamped_swiglu(acc_g, acc_u, limit, CLAMP), SB)
    tl.store(hq_ptr + rows[:, None] * inter + offs_n[None, :], hq,
             mask=out_mask[:, None] & (offs_n[None, :] < inter))
    h_groups = inter // SB
    offs_g = tl.program_id(1) * (BLOCK_N // SB) + tl.arange(0, BLOCK_N // SB)
    tl.store(he_ptr + rows[:, None] * h_groups + offs_g[None, :], he,
             mask=out_mask[:, None] & (offs_g[None, :] < h_groups))


@_jit
def _w8a8_down_kernel(
    hq_ptr, he_ptr, w2_ptr, s2_ptr, block_expert_ptr, out_ptr, n_rows, dim, inter, n_exp,
    ROUTED: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """out[r, n] = h[r]·W2[e, n]ᵀ in fp32 for one [BLOCK_M, BLOCK_N] tile (n over D)."""
    pdl_prologue(PDL)
    e, rows, _, in_mask, out_mask = _gemm_rows(tl.program_id(0), block_expert_ptr, block_expert_ptr, n_rows,
                                               n_exp, 1, ROUTED, False, BLOCK_M)
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, SB):
        offs_k = k0 + tl.arange(0, SB)
        a, a_scale = _act_tile(hq_ptr, he_ptr, rows, in_mask, k0, inter, SB)
        acc = _w8a8_step(acc, a, a_scale, w2_ptr, s2_ptr, e, offs_n, offs_k, k0, dim, inter, SB)
    tl.store(out_ptr + rows[:, None] * dim + offs_n[None, :], acc,
             mask=out_mask[:, None] & (offs_n[None, :] < dim))


# -------------------------------------------------------------------------------------- launchers


def act_quant(x: torch.Tensor, block: int, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Fused `act_quant_ref` (same signature, bit-equal), one launch. `out`: (q, exponent) buffers to
    write instead of new ones (`InputQuant` allocates them on the consumer's stream)."""
    require_triton()
    if x.dim() != 2:
        raise ValueError(f"x must be [M, D], got shape {tuple(x.shape)}")
    _check_groups(block, D=x.shape[1])
    n_rows, dim = x.shape
    x = x.contiguous()
    q, exponent = out if out is not None else act_quant_buffers(x, block)
    block_c = max(block, min(512, triton.next_power_of_2(dim)))
    grid = (triton.cdiv(n_rows, 8), triton.cdiv(dim, block_c))
    pdl = pdl_launch(x.device, math.prod(grid))
    _act_quant_kernel[grid](x, q, exponent, n_rows, dim, GROUP=block, BLOCK_R=8, BLOCK_C=block_c,
                            PDL=pdl, launch_pdl=pdl, num_warps=4)
    return q, exponent


def act_quant_buffers(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (q [M, D] e4m3, exponent [M, D/block] int32) for `act_quant` of x [M, D]."""
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], x.shape[1] // block), dtype=torch.int32, device=x.device))


def _tiles(rows_per_expert: float, block: int) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, up warps, down warps[, pipeline stages]; Triton's default stages when
    absent, as shipped). Few rows per expert (decode): the 16-row M tile of
    `moe._tiles`; prefill: 64-row tiles with 128-wide N (a multiple of every block in BLOCKS), 8 warps
    for 128-wide blocks and 4 for narrower ones: the fastest of `bench/moe_w8a8.py --tiles` at 8192
    V4-Flash tokens on one H100 (`moe-w8a8-h100-s34.json`: 7.20 / 14.91 ms, against 8.89 / 16.53 ms
    with the other warp count)."""
    if rows_per_expert <= 32:
        return 16, 128, 4, 4
    warps = 8 if block >= 128 else 4
    return 64, 128, warps, warps


def _launch_up(xq, xe, w1, w3, rows, block_expert, n_rows, n_out_rows, top_k, limit, tiles, block):
    """(hq [n_out_rows, I] e4m3, he [n_out_rows, I/B] int32): clamped SwiGLU of the gate/up GEMMs,
    quantised (rows=None: the shared expert)."""
    n_exp, inter, dim = (1, *w1.shape) if len(w1.shape) == 2 else w1.shape
    block_m, block_n, warps, _, *stages = tiles
    if block_n % block:  # the epilogue quantises whole B-column groups of h
        raise ValueError(f"W8A8 gate/up tiles need BLOCK_N a multiple of the block {block}, got {block_n}")
    hq = torch.empty((n_out_rows, inter), dtype=torch.float8_e4m3fn, device=xq.device)
    he = torch.empty((n_out_rows, inter // block), dtype=torch.int32, device=xq.device)
    routed = rows is not None
    grid = (triton.cdiv(n_out_rows, block_m), triton.cdiv(inter, block_n))
    pdl = pdl_launch(xq.device, math.prod(grid))
    _w8a8_up_kernel[grid](
        xq, xe, w1.data, w3.data, w1.scale, w3.scale, rows if routed else xe, block_expert if routed else xe,
        hq, he, n_rows, dim, inter, n_exp, top_k, float(limit),
        ROUTED=routed, SB=block, CLAMP=limit > 0, BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl, launch_pdl=pdl,
        num_warps=warps, **({"num_stages": stages[0]} if stages else {}),
    )
    return hq, he


def _launch_down(hq, he, w2, block_expert, n_rows, tiles, block):
    """out [rows of hq, D] fp32 = h·W2ᵀ per row's expert (block_expert=None: the shared expert)."""
    n_exp, dim, inter = (1, *w2.shape) if len(w2.shape) == 2 else w2.shape
    block_m, block_n, _, warps, *stages = tiles
    out = torch.empty((hq.shape[0], dim), dtype=torch.float32, device=hq.device)
    routed = block_expert is not None
    grid = (triton.cdiv(hq.shape[0], block_m), triton.cdiv(dim, block_n))
    pdl = pdl_launch(hq.device, math.prod(grid))
    _w8a8_down_kernel[grid](
        hq, he, w2.data, w2.scale, block_expert if routed else he, out, n_rows, dim, inter, n_exp,
        ROUTED=routed, SB=block, BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl, launch_pdl=pdl, num_warps=warps,
        **({"num_stages": stages[0]} if stages else {}),
    )
    return out


def moe_experts_w8a8(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *,
                     swiglu_limit: float, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                     x_ready: bool = False) -> torch.Tensor:
    """Fused `moe_experts_w8a8_ref` (same signature and shapes; module docstring for the pipeline).
    `x_fp8`: `act_quant(x, B)` computed already (on a side stream, `InputQuant`). `x_ready` is not used."""
    require_triton()
    _check_w8a8_args(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3)
    (w1, w2, w3, sw1, sw2, sw3), block = fp8_weights(w1, w2, w3, shared_w1, shared_w2, shared_w3)
    n_tok, dim = x.shape
    n_exp, inter, _ = w1.shape
    _check_groups(block, D=dim, I=inter, I_s=sw1.shape[0])
    weights, ids = weights.float().contiguous(), ids.to(torch.int32).contiguous()
    xq, xe = act_quant(x, block) if x_fp8 is None else x_fp8
    top_k = ids.shape[1]
    n_assign = n_tok * top_k
    tiles = _tiles(n_assign / min(n_exp, n_assign), block)
    rows, block_expert, slot = _pack_assignments(ids, n_exp, tiles[0])
    hq, he = _launch_up(xq, xe, w1, w3, rows, block_expert, n_assign, rows.numel(), top_k, swiglu_limit,
                        tiles, block)
    routed = _launch_down(hq, he, w2, block_expert, n_assign, tiles, block)  # [R, D] fp32
    shared_tiles = _tiles(n_tok, block)
    hq, he = _launch_up(xq, xe, sw1, sw3, None, None, n_tok, n_tok, 1, swiglu_limit, shared_tiles, block)
    shared = _launch_down(hq, he, sw2, None, n_tok, shared_tiles, block)  # [N, D] fp32
    return launch_finalize(routed, slot, weights, shared, x.dtype)


# ------------------------------------------------------------------------------ the registry op


class InputQuant:
    """The routed input's `act_quant` on a CUDA stream beside the caller's (`aside.Aside`), joined
    before its use.

    `start(x, block)` allocates the outputs on the caller's stream (so the caching allocator ties
    them to it), launches the quantisation on the side stream and returns a handle; `finish(handle)`
    makes the caller's stream wait for it and returns (q, exponent). Both capture into a CUDA graph
    as a fork and a join."""

    def __init__(self):
        self._aside = Aside()

    def start(self, x: torch.Tensor, block: int):
        out = act_quant_buffers(x, block)
        with self._aside.fork(x.device) as side:
            act_quant(x, block, out=out)
        return side, out

    @staticmethod
    def finish(handle) -> tuple[torch.Tensor, torch.Tensor]:
        side, out = handle
        join(side)
        return out


class W8A8MoeExperts:
    """`moe_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *, swiglu_limit)`,
    W8A8 (module docstring): the Triton kernels on CUDA with Triton, else `moe_experts_w8a8_ref` (the
    same arithmetic). Dense weights are quantised once and cached on this instance (one per module,
    nothing shared between models); `x_fp8` takes an early `quantize_input` (the MoE layer starts it
    before its router, so the two overlap)."""

    def __init__(self):
        self._weights: dict[tuple, tuple[list[FP8BlockWeight], int]] = {}
        self._input_quant = InputQuant()

    def _fp8(self, parts) -> tuple[list[FP8BlockWeight], int]:
        key = tuple(weight_key(w) for w in parts)
        if key not in self._weights:
            self._weights.clear()  # one weight set per module: a new key means new contents
            self._weights[key] = fp8_weights(*parts)
        return self._weights[key]

    def block(self, *weights) -> int:
        """The activation block these weights take (their FP8 block; DENSE_BLOCK for dense ones)."""
        return self._fp8(weights)[1]

    def quantize_input(self, x: torch.Tensor, *weights):
        """Start x's quantisation on the side stream (CUDA with Triton) and return a handle for
        `x_fp8`; None elsewhere (the call quantises in line)."""
        if x.device.type != "cuda" or not triton_available() or x.dim() != 2 or records_grad(x):
            return None
        return self._input_quant.start(x, self.block(*weights))

    def __call__(self, x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *, swiglu_limit: float,
                 x_fp8=None, x_ready: bool = False):  # x_ready: moe.moe_experts' promise, not used here
        (w1, w2, w3, sw1, sw2, sw3), _ = self._fp8((w1, w2, w3, shared_w1, shared_w2, shared_w3))
        if x.device.type == "cuda" and triton_available():
            early = None if x_fp8 is None else self._input_quant.finish(x_fp8)
            return moe_experts_w8a8(x, weights, ids, w1, w2, w3, sw1, sw2, sw3, swiglu_limit=swiglu_limit,
                                    x_fp8=early)
        return moe_experts_w8a8_ref(x, weights, ids, w1, w2, w3, sw1, sw2, sw3, swiglu_limit=swiglu_limit,
                                    x_fp8=x_fp8)

