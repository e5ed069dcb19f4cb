"""Decode-sized MoE router (N <= `moe.ROUTE_DECODE_MAX_TOKENS`): the logits GEMM split over the GPU.

`moe._moe_route_kernel` keeps all E logits of a 16-token tile in registers and walks D in 32-wide
steps, so a decode call is a single program looping D/32 times on one SM (26 µs at v4-mini's one
token, for 256 KB of gate weights). Here the same router runs as two launches:

1. `_route_logits_kernel`, grid (⌈N/16⌉, ⌈E/BLOCK_E⌉, S): program (i, j, s) computes the fp32 partial
   x·W_gᵀ of a 16-token × BLOCK_E-expert tile over the s-th chunk of D and stores it in
   partial[s] ([S, N, E] fp32). `plan_route` picks S from the shapes alone, so that the grid has
   about `RouteTiles.programs` programs.
2. `_route_select_kernel`, grid (N,): logits[t] = Σ_s partial[s, t] (one reduction over a
   [S_PAD, E_PAD] tile), then the prefill kernel's own epilogue `moe._route_pick`: sqrt-softplus,
   bias, top-k by argmax rounds (ties: lowest expert id) or hash ids, renormalisation, scaling.

No atomics: the reduction order is fixed by the shapes, so results are bitwise reproducible and equal
`moe.moe_route_ref` up to fp32 summation order. Buffers are sized from shapes only (no host sync), so
the call is CUDA-graph capturable. Shape symbols as in `moe.py`; S splits of D.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dspark.kernels.moe import _check_route_args, _dot, _jit, _route_pick, tl, triton
from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue, pdl_prologue_release

_BLOCK_T = 16  # tokens per logits program: tl.dot's minimum M (one decode token wastes rows, not bytes)
# The select kernel releases its successor before it waits for the logits (`pdl_prologue_release`): the decode
# MoE's early shared-expert rows (`moe_decode.decode_experts`' x_ready) then overlap both router launches.
RELEASE_FIRST = True
_MAX_SELECT_TILE = 8192  # fp32 partials one select program sums at once (S_PAD · E_PAD): 32 regs/thread at 8 warps


class RouteTiles(NamedTuple):
    """Launch shape of the logits kernel: experts per program (`block_e`, a power of 2 >= 16, as
    tl.dot needs), reduction step (`block_k`, a power of 2 >= 16), the grid size aimed at
    (`programs`; the H200 has 132 SMs) and warps per program."""

    block_e: int = 32
    block_k: int = 64
    programs: int = 128
    warps: int = 4


class RoutePlan(NamedTuple):
    """Static launch plan: the logits kernel's tiles, `chunk_steps` reduction steps per split,
    `splits` = S (each one non-empty) and the select kernel's padded tile [s_pad, e_pad]."""

    block_e: int
    block_k: int
    chunk_steps: int
    splits: int
    s_pad: int
    e_pad: int


def _check_tiles(tiles: RouteTiles) -> None:
    for name in ("block_e", "block_k"):
        value = getattr(tiles, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"RouteTiles.{name} must be a power of 2 >= 16, got {value}")
    if tiles.programs < 1:
        raise ValueError(f"RouteTiles.programs must be >= 1, got {tiles.programs}")
    if tiles.warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"RouteTiles.warps must be a power of 2 in [1, 16], got {tiles.warps}")


def plan_route(n_tok: int, dim: int, n_exp: int, tiles: RouteTiles = RouteTiles()) -> RoutePlan:
    """Split D into S chunks of whole `block_k` steps so that the logits grid has about
    `tiles.programs` programs, S at most ⌈D/block_k⌉ and S_PAD · E_PAD <= _MAX_SELECT_TILE."""
    _check_tiles(tiles)
    e_pad = max(16, triton.next_power_of_2(n_exp))
    block_e = min(tiles.block_e, e_pad)
    k_steps = triton.cdiv(dim, tiles.block_k)
    tiles_tn = triton.cdiv(n_tok, _BLOCK_T) * triton.cdiv(n_exp, block_e)
    splits = max(1, min(k_steps, triton.cdiv(tiles.programs, tiles_tn), _MAX_SELECT_TILE // e_pad))
    chunk_steps = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, chunk_steps)  # drop splits that rounding left empty
    return RoutePlan(block_e, tiles.block_k, chunk_steps, splits, triton.next_power_of_2(splits), e_pad)


@_jit
def _route_logits_kernel(x_ptr, gw_ptr, part_ptr, n_tok, dim, n_exp, chunk_steps,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    """partial[s, offs_t, offs_e] = Σ over D-chunk s of x[offs_t]·W_g[offs_e], fp32."""
    pdl_prologue(PDL)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    t_mask = offs_t < n_tok
    e_mask = offs_e < n_exp
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for i in range(0, chunk_steps):
        offs_k = (split * chunk_steps + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < dim
        xa = tl.load(x_ptr + offs_t[:, None] * dim + offs_k[None, :],
                     mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(gw_ptr + offs_e[:, None].to(tl.int64) * dim + offs_k[None, :],
                     mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            xa = xa.to(tl.float32)
        acc = _dot(xa, wg.to(xa.dtype), acc, DOT_FP32)  # bf16: exact products, fp32 sums
    rows = split.to(tl.int64) * n_tok + offs_t
    tl.store(part_ptr + rows[:, None] * n_exp + offs_e[None, :], acc, mask=t_mask[:, None] & e_mask[None, :])


@_jit
def _route_select_kernel(part_ptr, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr,
                         n_tok, n_exp, n_splits, scaling,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                         HASH: tl.constexpr, BIAS_ROWS: tl.constexpr, RELEASE_FIRST: tl.constexpr,
                         PDL: tl.constexpr):
    """Token t = program 0: logits = Σ_s partial[s, t] over a [S_PAD, E_PAD] tile, then `_route_pick`.
    RELEASE_FIRST: the successor (the decode MoE's gate/up launch) is released before the wait for the logits,
    so that its early shared-expert rows overlap the logits kernel too."""
    pdl_prologue_release(RELEASE_FIRST, PDL)
    offs_t = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)  # [1]: one token per program
    offs_s = tl.arange(0, S_PAD).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    e_mask = offs_e < n_exp
    rows = offs_s * n_tok + offs_t
    part = tl.load(part_ptr + rows[:, None] * n_exp + offs_e[None, :],
                   mask=(offs_s[:, None] < n_splits) & e_mask[None, :], other=0.0)
    logits = tl.sum(part, axis=0)[None, :]  # [1, E_PAD]
    _route_pick(logits, offs_t, offs_t < n_tok, offs_e, e_mask, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr,
                id_out_ptr, scaling, n_exp, TOP_K, K_PAD, 1, HASH, BIAS_ROWS)


def route_decode(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int, routed_scaling_factor: float,
                 hash_routing: bool, bias_rows: bool = False, tiles: RouteTiles | None = None):
    """`moe.moe_route_ref` (same signature, plus the launch shape) as the two split-K kernels; any N
    works, `moe.moe_route` sends N <= ROUTE_DECODE_MAX_TOKENS here.

    Shape: x [N, D]; gate_weight [E, D]; gate_bias [E] (score routing; [N, E] with `bias_rows`);
    tid2eid [V, K] and token_ids [N] (hash routing). Returns weights [N, K] fp32 and ids [N, K] int32.
    """
    require_triton()
    _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing, bias_rows)
    n_tok, dim = x.shape
    n_exp = gate_weight.shape[0]
    tiles = RouteTiles() if tiles is None else tiles
    plan = plan_route(n_tok, dim, n_exp, tiles)
    x, gate_weight = x.contiguous(), gate_weight.contiguous()
    partial = torch.empty((plan.splits, n_tok, n_exp), dtype=torch.float32, device=x.device)  # [S, N, E]
    grid = (triton.cdiv(n_tok, _BLOCK_T), triton.cdiv(n_exp, plan.block_e), plan.splits)
    pdl = pdl_launch(x.device, math.prod(grid))
    _route_logits_kernel[grid](
        x, gate_weight, partial, n_tok, dim, n_exp, plan.chunk_steps,
        BLOCK_T=_BLOCK_T, BLOCK_E=plan.block_e, BLOCK_K=plan.block_k, num_warps=tiles.warps,
        DOT_FP32=x.dtype == torch.float32 or gate_weight.dtype == torch.float32, PDL=pdl, launch_pdl=pdl,
    )
    weights = torch.empty((n_tok, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((n_tok, top_k), dtype=torch.int32, device=x.device)
    pdl = pdl_launch(x.device, n_tok)
    _route_select_kernel[(n_tok,)](
        partial, x if hash_routing else gate_bias.float().contiguous(),
        tid2eid.contiguous() if hash_routing else x, token_ids.contiguous() if hash_routing else x,
        weights, ids, n_tok, n_exp, plan.splits, float(routed_scaling_factor),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=plan.e_pad, S_PAD=plan.s_pad,
        HASH=bool(hash_routing), RELEASE_FIRST=RELEASE_FIRST, PDL=pdl, launch_pdl=pdl,
        num_warps=4 if plan.s_pad * plan.e_pad <= 4096 else 8, BIAS_ROWS=bias_rows,
    )
    return weights, ids
