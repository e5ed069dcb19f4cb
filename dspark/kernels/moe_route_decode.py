"""Decode-sized MoE router (N <= `moe.ROUTE_DECODE_MAX_TOKENS`): the logits GEMM split over the GPU.

`moe._moe_route_kernel` keeps all E logits of a 16-token tile in registers and walks D in 32-wide
steps, so a decode call is a single program looping D/32 times on one SM (26 µs at v4-mini's one
token, for 256 KB of gate weights). Here the logits are split over many programs, and the prefill
kernel's own epilogue `moe._route_pick` (sqrt-softplus, bias, top-k by argmax rounds (ties: lowest
expert id) or hash ids, renormalisation, scaling) runs on their sum, in one of two modes:

* two launches (`tickets` None, or N > `SELECT_FOLD_MAX_TOKENS`):

  1. `_route_logits_kernel`, grid (⌈N/16⌉, ⌈E/BLOCK_E⌉, S): program (i, j, s) computes the fp32
     partial x·W_gᵀ of a 16-token × BLOCK_E-expert tile over the s-th chunk of D and stores it in
     partial[s] ([S, N, E] fp32). `plan_route` picks S from the shapes alone, so that the grid has
     about `RouteTiles.programs` programs.
  2. `_route_select_kernel`, grid (N,): logits[t] = Σ_s partial[s, t] (one reduction over a
     [S_PAD, E_PAD] tile), then `_route_pick` (both in `_select_token`).

* one launch (a `tickets` buffer and N <= `SELECT_FOLD_MAX_TOKENS`): `_route_fold_kernel`, the
  logits kernel's grid and programs; after storing its partial tile each program takes a ticket on
  its token tile's counter (tickets[i], int32), and the last of the tile's ⌈E/BLOCK_E⌉·S programs
  puts the counter back to 0 and runs `_select_token` for each token of the tile, one after another
  (reading the other programs' parts from L2). The buffer is the caller's (zeroed once, e.g. a model
  buffer: `route_tickets`); every call leaves it zero. One kernel launch less per MoE layer at decode.

No atomics on the values: the reduction order is fixed by the shapes, so results are bitwise
reproducible, the same in both modes (the same ops on the same partials; on the GPU up to the
reduction layout of the select's warps) and equal `moe.moe_route_ref` up to fp32 summation order.
Buffers are sized from shapes only (no host sync), so the call is CUDA-graph capturable. Shape
symbols as in `moe.py`; S splits of D.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dspark.kernels.moe import _check_route_args, _dot, _jit, _route_pick, tl, triton
from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

_BLOCK_T = 16  # tokens per logits program: tl.dot's minimum M (one decode token wastes rows, not bytes)
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
def _logits_part(x_ptr, gw_ptr, part_ptr, n_tok, dim, n_exp, chunk_steps, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Program (i, j, s): partial[s, offs_t, offs_e] = Σ over D-chunk s of x[offs_t]·W_g[offs_e], fp32
    (tokens offs_t of tile i, experts offs_e of block j); partial [S, N, E]."""
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
def _select_token(part_ptr, t, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr, n_tok, n_exp, n_splits,
                  scaling, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  HASH: tl.constexpr, BIAS_ROWS: tl.constexpr, FROM_L2: tl.constexpr):
    """Token t: logits = Σ_s partial[s, t] over a [S_PAD, E_PAD] tile, then `_route_pick` (weights and
    ids [N, K] stored). FROM_L2: the partials are loaded with .cg (other SMs of this launch stored
    them, so this SM's L1 may not hold their values; the value loaded is the same)."""
    offs_t = (t + tl.arange(0, 1)).to(tl.int64)  # [1]: one token
    offs_s = tl.arange(0, S_PAD).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    e_mask = offs_e < n_exp
    rows = offs_s * n_tok + offs_t
    ptrs = part_ptr + rows[:, None] * n_exp + offs_e[None, :]
    mask = (offs_s[:, None] < n_splits) & e_mask[None, :]
    if FROM_L2:
        part = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        part = tl.load(ptrs, mask=mask, other=0.0)
    logits = tl.sum(part, axis=0)[None, :]  # [1, E_PAD]
    _route_pick(logits, offs_t, offs_t < n_tok, offs_e, e_mask, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr,
                id_out_ptr, scaling, n_exp, TOP_K, K_PAD, 1, HASH, BIAS_ROWS)


@_jit
def _route_logits_kernel(x_ptr, gw_ptr, part_ptr, n_tok, dim, n_exp, chunk_steps,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    """First of the two launches: `_logits_part`."""
    pdl_prologue(PDL)
    _logits_part(x_ptr, gw_ptr, part_ptr, n_tok, dim, n_exp, chunk_steps, BLOCK_T, BLOCK_E, BLOCK_K, DOT_FP32)


@_jit
def _route_select_kernel(part_ptr, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr,
                         n_tok, n_exp, n_splits, scaling,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                         HASH: tl.constexpr, BIAS_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Second of the two launches: `_select_token` for token t = program 0 (the previous launch stored
    every partial, so plain loads)."""
    pdl_prologue(PDL)
    _select_token(part_ptr, tl.program_id(0), bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr, n_tok, n_exp,
                  n_splits, scaling, TOP_K, K_PAD, E_PAD, S_PAD, HASH, BIAS_ROWS, False)


@_jit
def _route_fold_kernel(x_ptr, gw_ptr, part_ptr, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr, ticket_ptr,
                       n_tok, dim, n_exp, chunk_steps, n_splits, scaling,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                       HASH: tl.constexpr, BIAS_ROWS: tl.constexpr, PDL: tl.constexpr):
    """The one-launch mode: `_logits_part`, then a ticket on tile i's counter (ticket_ptr[i], int32, 0
    on entry); the last of the tile's programs (every E-block and split) puts the counter back to 0 for
    the next call and runs `_select_token` for each of the tile's tokens in turn."""
    pdl_prologue(PDL)
    _logits_part(x_ptr, gw_ptr, part_ptr, n_tok, dim, n_exp, chunk_steps, BLOCK_T, BLOCK_E, BLOCK_K, DOT_FP32)
    tl.debug_barrier()  # every thread's part stored before the ticket releases them (acq_rel, GPU scope)
    counter = ticket_ptr + tl.program_id(0)
    tile_programs = tl.num_programs(1) * tl.num_programs(2)
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tile_programs - 1:
        # Every program of the tile has taken its ticket: nothing else touches the counter in this launch,
        # so it goes back to 0 now (stored after the loop, the store's lane predicate stayed live across
        # the selects and ptxas spilled it on sm_90).
        tl.store(counter, 0)
        first = tl.program_id(0) * BLOCK_T
        for t in range(first, tl.minimum(first + BLOCK_T, n_tok)):  # from L2 (.cg): other SMs stored the parts
            _select_token(part_ptr, t, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr, n_tok, n_exp,
                          n_splits, scaling, TOP_K, K_PAD, E_PAD, S_PAD, HASH, BIAS_ROWS, True)


def ticket_count(n_tok: int) -> int:
    """Ticket counters a one-launch call of `n_tok` tokens needs: one per 16-token tile."""
    return -(-n_tok // _BLOCK_T)


def route_tickets(device=None, max_tokens: int | None = None) -> torch.Tensor:
    """A zeroed ticket buffer for calls of up to `max_tokens` tokens (default: `moe.ROUTE_DECODE_MAX_TOKENS`,
    every call `moe.moe_route` sends here): int32 [⌈max_tokens/16⌉] on `device`. Each call that uses it
    leaves it zero again, so one buffer serves every call in stream order (not two calls in flight at
    once on different streams)."""
    from dspark.kernels.moe import ROUTE_DECODE_MAX_TOKENS

    n_tok = ROUTE_DECODE_MAX_TOKENS if max_tokens is None else max_tokens
    return torch.zeros(ticket_count(n_tok), dtype=torch.int32, device=device)


def _check_tickets(tickets, x) -> None:
    """A ticket buffer for x [N, D]: int32, contiguous, >= ⌈N/16⌉ counters, on x's device. Its zeros are
    the caller's to keep (checking them would read the device from the host: no graph capture)."""
    if not isinstance(tickets, torch.Tensor):
        raise ValueError(f"tickets must be an int32 tensor or None, got {type(tickets).__name__}")
    if tickets.dtype != torch.int32:
        raise ValueError(f"tickets must be int32, got {tickets.dtype}")
    if not tickets.is_contiguous():
        raise ValueError(f"tickets must be contiguous, got strides {tuple(tickets.stride())}")
    if tickets.numel() < ticket_count(x.shape[0]):
        raise ValueError(f"tickets must hold >= {ticket_count(x.shape[0])} counters for N={x.shape[0]} tokens, "
                         f"got {tickets.numel()}")
    if tickets.device != x.device:
        raise ValueError(f"tickets must be on x's device {x.device}, got {tickets.device}")


# One launch instead of two up to this many tokens. A guess, to be tuned on the GPU: the last program of
# a tile runs the selects of its tokens one after another (where the select kernel gives each token a
# program), so the saved launch gap (a few µs) is traded for N serial selects on one SM.
SELECT_FOLD_MAX_TOKENS = 4


def route_decode(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int, routed_scaling_factor: float,
                 hash_routing: bool, bias_rows: bool = False, tiles: RouteTiles | None = None, tickets=None):
    """`moe.moe_route_ref` (same signature, plus the launch shape) as the split-K kernels; any N
    works, `moe.moe_route` sends N <= ROUTE_DECODE_MAX_TOKENS here. Two launches, or one where
    `tickets` is given and N <= SELECT_FOLD_MAX_TOKENS (module docstring); the same results.

    Shape: x [N, D]; gate_weight [E, D]; gate_bias [E] (score routing; [N, E] with `bias_rows`);
    tid2eid [V, K] and token_ids [N] (hash routing); tickets None or int32 [>= ⌈N/16⌉], zero (e.g.
    `route_tickets()`; left zero). Returns weights [N, K] fp32 and ids [N, K] int32.
    """
    require_triton()
    _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing, bias_rows)
    if tickets is not None:
        _check_tickets(tickets, x)
    n_tok = x.shape[0]
    tiles = RouteTiles() if tiles is None else tiles
    plan = plan_route(n_tok, x.shape[1], gate_weight.shape[0], tiles)
    x, gate_weight = x.contiguous(), gate_weight.contiguous()
    weights = torch.empty((n_tok, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((n_tok, top_k), dtype=torch.int32, device=x.device)
    # the select's operands: bias, tid2eid, token ids (x stands in for those the routing does not read), outputs
    picks = (x if hash_routing else gate_bias.float().contiguous(), tid2eid.contiguous() if hash_routing else x,
             token_ids.contiguous() if hash_routing else x, weights, ids)
    select = dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=plan.e_pad, S_PAD=plan.s_pad,
                  HASH=bool(hash_routing), BIAS_ROWS=bias_rows)
    if tickets is not None and n_tok <= SELECT_FOLD_MAX_TOKENS:
        _launch_fold(x, gate_weight, picks, tickets, float(routed_scaling_factor), plan, tiles, select)
    else:
        _launch_split(x, gate_weight, picks, float(routed_scaling_factor), plan, tiles, select)
    return weights, ids


def _logits_launch(x, gate_weight, plan: RoutePlan):
    """(partial [S, N, E] fp32, the logits grid, the logits tile's constexprs) of either mode."""
    n_tok, n_exp = x.shape[0], gate_weight.shape[0]
    partial = torch.empty((plan.splits, n_tok, n_exp), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_tok, _BLOCK_T), triton.cdiv(n_exp, plan.block_e), plan.splits)
    consts = dict(BLOCK_T=_BLOCK_T, BLOCK_E=plan.block_e, BLOCK_K=plan.block_k,
                  DOT_FP32=x.dtype == torch.float32 or gate_weight.dtype == torch.float32)
    return partial, grid, consts


def _launch_split(x, gate_weight, picks: tuple, scaling: float, plan: RoutePlan, tiles: RouteTiles, select: dict):
    """The two launches: `_route_logits_kernel`, then `_route_select_kernel` (one program per token)."""
    (n_tok, dim), n_exp = x.shape, gate_weight.shape[0]
    partial, grid, logits = _logits_launch(x, gate_weight, plan)
    pdl = pdl_launch(x.device, math.prod(grid))
    _route_logits_kernel[grid](
        x, gate_weight, partial, n_tok, dim, n_exp, plan.chunk_steps, **logits, num_warps=tiles.warps, PDL=pdl,
        launch_pdl=pdl,
    )
    pdl = pdl_launch(x.device, n_tok)
    _route_select_kernel[(n_tok,)](
        partial, *picks, n_tok, n_exp, plan.splits, scaling, **select, PDL=pdl, launch_pdl=pdl,
        num_warps=4 if plan.s_pad * plan.e_pad <= 4096 else 8,
    )


def _launch_fold(x, gate_weight, picks: tuple, tickets, scaling: float, plan: RoutePlan, tiles: RouteTiles,
                 select: dict):
    """The one launch: `_route_fold_kernel` on the logits kernel's grid and warps (its logits tiles are the
    logits kernel's), counting on `tickets`."""
    (n_tok, dim), n_exp = x.shape, gate_weight.shape[0]
    partial, grid, logits = _logits_launch(x, gate_weight, plan)
    pdl = pdl_launch(x.device, math.prod(grid))
    _route_fold_kernel[grid](
        x, gate_weight, partial, *picks, tickets, n_tok, dim, n_exp, plan.chunk_steps, plan.splits, scaling,
        **logits, **select, num_warps=tiles.warps, PDL=pdl, launch_pdl=pdl,
    )
