"""The decode MoE's launches with their weights streamed by the Tensor Memory Accelerator (Hopper).

`moe_decode._decode_up_kernel` loads each weight tile into registers with ordinary loads; at decode
sizes it is latency-bound (Nsight Compute on the H200: issue slots half idle, 50–66 % of DRAM
bandwidth), as each warp keeps only a few loads in flight. `_tma_up_kernel` computes the same rows
with the gate and up tiles copied by TMA descriptor loads in a software-pipelined loop: Triton gives
each program STAGES − 1 shared-memory buffers per weight and issues the copies of the next steps while
this one is summed, so an SM holds tens of KB of weights in flight at little register cost.

Grid (N·K + N, ⌈max(I, I_s)/BLOCK_N⌉), as the GEMV kernel's: work row a < N·K is assignment a (token
a // K, expert ids[a]), row N·K + t token t's shared expert; h[a] = silu(min(x·W1ᵀ, L)) ·
clamp(x·W3ᵀ, −L, L) in fp32, laid out as `decode_up`'s h, so `moe_decode._decode_down_kernel` reads it
unchanged (and the split down kernel's ticket counters are zeroed here as there). The fp32 sums run
in another order than the GEMV kernel's ([BLOCK_N, BLOCK_K] accumulators, summed over columns once).

`_tma_down_kernel` (`tma_down`; in `moe_decode`'s tables for dense weights at several tokens, `DOWN_TMA`;
a first form with one program per row block lost at 8 tokens) computes `moe_decode._decode_down_kernel`'s
y the same way, each row block's K + 1 expert slots spread over SPLIT programs whose fp32 parts the last
to finish adds.

`_tma_fused_kernel` (`tma_fused`) runs both in one launch: each program takes the next work item from a
counter, gate/up items first (a-major), then down items, one expert slot of one row block each; a down
item waits for its own work row's h (a done count per row), so it starts while later rows still stream,
and the last of a row block's K + 1 slots adds them (the ticket protocol). The tables use it where it won
(`moe_decode.FUSED`: one token, V4-Flash widths, FP8 32×32 and dense weights). Given counters zeroed before the
router launched (`fused_counters`; `fused_moe` makes them), its EARLY form runs the shared rows' gate/up items
first and before the PDL wait, as `_tma_up_kernel`'s EARLY grid does.

`tma_up(..., early=True)` (`moe_decode.decode_experts`' `x_ready`, at one token) launches `_tma_up_kernel`'s
EARLY grid: the shared experts' rows first, their programs streaming before the PDL wait (they read only x and
the shared weights) and waiting only before they store, so that they overlap the router; the routed rows wait
for the ids as usual, and run in the usual grid's order (row block by row block).

FP8 weights (`FP8BlockWeight`): each program's rows lie in one scale row (BLOCK_N divides the block),
so each column's UE8M0 factor (a power of two: exact) multiplies the activations instead of the weights.

Descriptors are made on the host per call (`triton.tools.tensor_descriptor.TensorDescriptor`); no
host sync, CUDA-graph capturable (the weights do not move). TMA needs compute capability 9 and rows
16-byte aligned (`supported`); elsewhere `moe_decode` keeps the GEMV kernel. Shape symbols as in `moe.py`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dspark.kernels.moe import _clamped_swiglu, _jit, _split_store, _weight_parts, tl, triton
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue, pdl_prologue_unless, pdl_wait_if, sm90


class TmaTiles(NamedTuple):
    """Launch shape of `_tma_up_kernel`: output rows per program (`n`, a power of two dividing any FP8
    block), columns per TMA tile (`k`, a power of two >= 16, a multiple or divisor of the FP8 block),
    warps, and the software pipeline's depth (`stages`: stages − 1 tiles of each weight in flight)."""

    n: int = 16
    k: int = 256
    warps: int = 4
    stages: int = 5


# The down kernel's shapes `bench/moe_decode_tma.py --down` sweeps (`moe_decode.DOWN_TMA` picks from them).
DOWN_SWEEP = (TmaTiles(8, 512, 4, 4), TmaTiles(16, 256, 4, 4), TmaTiles(16, 512, 8, 4), TmaTiles(32, 256, 8, 3))
# The down items' shapes `bench/moe_decode_tma.py --fused` sweeps for `tma_fused` (`moe_decode.FUSED` picks).
FUSED_DOWN = (TmaTiles(16, 256, 4, 4), TmaTiles(16, 512, 4, 3), TmaTiles(32, 256, 4, 4))


@_jit
def _scaled(v, s_ptr, e, n0, k0, n_out, n_in, FP8: tl.constexpr, SB: tl.constexpr, BLOCK_K: tl.constexpr):
    """v [BLOCK_K] fp32 times each column's UE8M0 factor of scale row n0 // SB of expert e (FP8), else v."""
    if FP8:
        cols = k0 + tl.arange(0, BLOCK_K)
        s_cols = tl.cdiv(n_in, SB)
        byte = tl.load(s_ptr + (e * tl.cdiv(n_out, SB) + n0 // SB) * s_cols + cols // SB, mask=cols < n_in,
                       other=127)
        v = v * (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
    return v


@_jit
def _swiglu_tma(x_row_ptr, g_desc, u_desc, sg_ptr, su_ptr, e, n0, n_out, dim, limit, FP8: tl.constexpr,
                SB: tl.constexpr, CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr):
    """Clamped SwiGLU of one token's row for rows n0 .. n0 + BLOCK_N of expert e: fp32 [BLOCK_N]."""
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, dim, BLOCK_K, num_stages=STAGES):
        g = g_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        u = u_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
        acc_g += g.to(tl.float32) * _scaled(x, sg_ptr, e, n0, k0, n_out, dim, FP8, SB, BLOCK_K)[None, :]
        acc_u += u.to(tl.float32) * _scaled(x, su_ptr, e, n0, k0, n_out, dim, FP8, SB, BLOCK_K)[None, :]
    return _clamped_swiglu(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit, CLAMP)


@_jit
def _tma_up_kernel(x_ptr, ids_ptr, g_desc, u_desc, sg_ptr, su_ptr, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, h_ptr,
                   ticket_ptr, n_assign, dim, inter, inter_s, h_width, limit, TOP_K: tl.constexpr,
                   FP8: tl.constexpr, SB: tl.constexpr, FP8_S: tl.constexpr, SB_S: tl.constexpr,
                   CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                   TICKETS: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """h[a, n0 : n0 + BLOCK_N] for work row a: routed assignment a < N·K, else token a − N·K's shared
    expert. TICKETS > 0: programs (t < N, 0) also zero token t's counters of the split down kernel.
    EARLY: a 1-D grid whose first N·⌈h width / BLOCK_N⌉ programs take the shared experts' rows, which do
    not wait for the predecessor (the router: the shared expert reads only x and its own weights), so
    they stream while it runs; the routed rows follow and wait for the ids. Both parts run row block by
    row block, every work row's block b before any row's block b + 1, as the usual grid does, so that the
    programs in flight read all the experts at once. (The first EARLY grid, one expert after another,
    took 48.6 µs against the usual grid's 46.0 at one token under Nsight Compute on an H100.)"""
    n_tok = n_assign // TOP_K
    if EARLY:
        pid = tl.program_id(0)
        n_shared = n_tok * tl.cdiv(h_width, BLOCK_N)
        shared = pid < n_shared
        r = tl.where(shared, pid, pid - n_shared)  # the program's place within its part
        width = tl.where(shared, n_tok, n_assign)  # work rows of its part
        a = tl.where(shared, n_assign, 0) + r % width
        n0 = (r // width) * BLOCK_N
    else:
        a = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
    # the shared rows with EARLY (they load at once and store after the wait); none without (a < N·K + N)
    early = a >= n_assign + (0 if EARLY else n_tok)
    pdl_prologue_unless(early, PDL)
    if TICKETS > 0:
        if (a < n_tok) & (n0 == 0):
            tl.store(ticket_ptr + a * TICKETS + tl.arange(0, TICKETS), tl.zeros((TICKETS,), dtype=tl.int32))
    _up_rows(x_ptr, ids_ptr, g_desc, u_desc, sg_ptr, su_ptr, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, h_ptr, a, n0,
             n_assign, dim, inter, inter_s, h_width, limit, TOP_K, FP8, SB, FP8_S, SB_S, CLAMP, BLOCK_N, BLOCK_K,
             STAGES, early, PDL)


@_jit
def _up_rows(x_ptr, ids_ptr, g_desc, u_desc, sg_ptr, su_ptr, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, h_ptr, a, n0,
             n_assign, dim, inter, inter_s, h_width, limit, TOP_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
             FP8_S: tl.constexpr, SB_S: tl.constexpr, CLAMP: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, STAGES: tl.constexpr, early, PDL: tl.constexpr):
    """Stores h[a, n0 : n0 + BLOCK_N] of work row a: routed assignment a < N·K, else token a − N·K's shared
    expert. `early`: a program that skipped the PDL wait (`pdl_prologue_unless`) waits before the store."""
    if a < n_assign:
        e = tl.load(ids_ptr + a)
        h = _swiglu_tma(x_ptr + (a // TOP_K).to(tl.int64) * dim, g_desc, u_desc, sg_ptr, su_ptr, e, n0, inter, dim,
                        limit, FP8, SB, CLAMP, BLOCK_N, BLOCK_K, STAGES)
        n_out = inter
    else:
        h = _swiglu_tma(x_ptr + (a - n_assign).to(tl.int64) * dim, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, 0, n0,
                        inter_s, dim, limit, FP8_S, SB_S, CLAMP, BLOCK_N, BLOCK_K, STAGES)
        n_out = inter_s
    offs_n = n0 + tl.arange(0, BLOCK_N)
    pdl_wait_if(early, PDL)
    tl.store(h_ptr + a.to(tl.int64) * h_width + offs_n, h, mask=offs_n < n_out)


@_jit
def _tma_down_kernel(h_ptr, ids_ptr, wts_ptr, d_desc, s_ptr, ds_desc, ss_ptr, y_ptr, part_ptr, ticket_ptr, n_assign,
                     dim, inter, inter_s, h_width, ticket_stride, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     FP8: tl.constexpr, SB: tl.constexpr, FP8_S: tl.constexpr, SB_S: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                     PDL: tl.constexpr):
    """y[t, n0 : n0 + BLOCK_N] = h[shared t] · W2_sᵀ + Σ_k w[t, k] · h[t·K + k] · W2[ids[t, k]]ᵀ, as
    `moe_decode._decode_down_kernel`. Program (t, row block, s) takes the expert slots j ≡ s (mod SPLIT),
    j = 0 the shared expert and j = 1..K the routed ones (their steps in one flat pipelined loop, the
    routing weight folded into h; the ids are read before the loop, so no load feeds a descriptor's
    coordinates inside it). SPLIT > 1: each program stores its fp32 sum in part[t, s] and the last of
    the SPLIT programs of (t, row block) to take a ticket adds them in order s = 0..SPLIT − 1 and stores y
    (the GEMV kernel's protocol: counters zeroed by the up launch, put back to 0 here)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    s = tl.program_id(2)
    slot = tl.arange(0, K_PAD)
    ids = tl.load(ids_ptr + t * TOP_K + slot, mask=slot < TOP_K, other=0)
    wts = tl.load(wts_ptr + t * TOP_K + slot, mask=slot < TOP_K, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if s == 0:  # slot 0: the shared expert
        for k0 in tl.range(0, inter_s, BLOCK_K, num_stages=STAGES):
            w = ds_desc.load([0, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            cols = k0 + tl.arange(0, BLOCK_K)
            hv = tl.load(h_ptr + (n_assign + t) * h_width + cols, mask=cols < inter_s, other=0.0)
            acc += w.to(tl.float32) * _scaled(hv, ss_ptr, 0, n0, k0, dim, inter_s, FP8_S, SB_S, BLOCK_K)[None, :]
    first = s + SPLIT * (s == 0)  # this program's first routed slot j >= 1
    n_steps = tl.cdiv(inter, BLOCK_K)
    for i in tl.range(0, (TOP_K + SPLIT - first) // SPLIT * n_steps, num_stages=STAGES):
        m = i // n_steps
        k0 = (i - m * n_steps) * BLOCK_K
        k = first + m * SPLIT - 1  # routed slot j = k + 1
        e = tl.sum(tl.where(slot == k, ids, 0))
        w = d_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        hv = tl.load(h_ptr + (t * TOP_K + k) * h_width + cols, mask=cols < inter, other=0.0)
        hv = hv * tl.sum(tl.where(slot == k, wts, 0.0))
        acc += w.to(tl.float32) * _scaled(hv, s_ptr, e, n0, k0, dim, inter, FP8, SB, BLOCK_K)[None, :]
    out = tl.sum(acc, axis=1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < dim
    if SPLIT == 1:
        tl.store(y_ptr + t * dim + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        _split_store(y_ptr, part_ptr, ticket_ptr, out, t, s, offs_n, n_mask, dim, ticket_stride, SPLIT,
                     tl.program_id(1))


@_jit
def _down_row_tma(h_row_ptr, d_desc, s_ptr, e, weight, n0, n_out, n_in, FP8: tl.constexpr, SB: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """fp32 [BLOCK_N]: weight · W2[e, n0 : n0 + BLOCK_N] · h_row, h read from L2 (`.cg`: other SMs wrote it)."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, n_in, BLOCK_K, num_stages=STAGES):
        w = d_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        hv = tl.load(h_row_ptr + cols, mask=cols < n_in, other=0.0, cache_modifier=".cg") * weight
        acc += w.to(tl.float32) * _scaled(hv, s_ptr, e, n0, k0, n_out, n_in, FP8, SB, BLOCK_K)[None, :]
    return tl.sum(acc, axis=1)


@_jit
def _next_item(sync_ptr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """`_tma_fused_kernel`'s next work item from its counter (sync[0]). Without EARLY the counter was zeroed
    by the launch before (`tma_fused`'s own buffer), so the program waits for it first; with EARLY it was
    zeroed before the router's launches (`fused_counters`), so it is read at once."""
    if not EARLY:
        pdl_wait_if(True, PDL)
    return tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")


@_jit
def _tma_fused_kernel(x_ptr, ids_ptr, wts_ptr, g_desc, u_desc, sg_ptr, su_ptr, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr,
                      d_desc, s2_ptr, ds_desc, ss2_ptr, h_ptr, y_ptr, part_ptr, sync_ptr, ticket_ptr, n_assign, dim,
                      inter, inter_s, h_width, limit, up_blocks, down_blocks, TOP_K: tl.constexpr, FP8: tl.constexpr,
                      SB: tl.constexpr, FP8_S: tl.constexpr, SB_S: tl.constexpr, FP8_D: tl.constexpr,
                      SB_D: tl.constexpr, FP8_DS: tl.constexpr, SB_DS: tl.constexpr, CLAMP: tl.constexpr,
                      UP_N: tl.constexpr, UP_K: tl.constexpr, UP_STAGES: tl.constexpr, DOWN_N: tl.constexpr,
                      DOWN_K: tl.constexpr, DOWN_STAGES: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """The experts in one launch. Each program takes the next work item from a counter (sync[0]), so items
    start in order: first the gate/up items (work row, row block; row-major, `_up_rows`), each of which
    then counts itself done in sync[1 + a] (release, GPU scope) for its work row a; then the down items (work
    row, row block of D), each of which waits until all ⌈h width / UP_N⌉ up items of its row are done
    (acquire) and adds its routing-weighted slot to y through `_split_store` (slot j = 0 the shared expert,
    k + 1 routed slot k; the last of the K + 1 adds them in order). No deadlock: an item waits only on items
    taken before it, by programs already running that wait on nothing but the predecessor grid. A down item
    starts as soon as its own row's h is complete, while later rows' gate/up items still stream.
    Rows in item order: the routed rows, then the shared ones; EARLY (`tma_fused`'s `counters`, made before
    the router launched): the shared rows first, and their gate/up items load (x and the shared weights only)
    before the PDL wait, storing h after it, so that they overlap the router, as `_tma_up_kernel`'s EARLY grid."""
    item = _next_item(sync_ptr, EARLY, PDL)
    n_tok = n_assign // TOP_K
    n_up = (n_assign + n_tok) * up_blocks
    if EARLY:
        early = item < n_tok * up_blocks  # the shared rows' gate/up items
    else:
        early = item < 0
    pdl_prologue_unless(early, PDL)
    r = tl.where(item < n_up, item // up_blocks, (item - n_up) // down_blocks)  # the item's row in item order
    if EARLY:
        a = tl.where(r < n_tok, n_assign + r, r - n_tok)
    else:
        a = r
    if item < n_up:
        _up_rows(x_ptr, ids_ptr, g_desc, u_desc, sg_ptr, su_ptr, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, h_ptr, a,
                 (item - r * up_blocks) * UP_N, n_assign, dim, inter, inter_s, h_width, limit, TOP_K, FP8, SB, FP8_S,
                 SB_S, CLAMP, UP_N, UP_K, UP_STAGES, early, PDL)
        tl.debug_barrier()  # every thread's h stored before the count releases them
        tl.atomic_add(sync_ptr + 1 + a, 1, sem="release", scope="gpu")
    else:
        block = item - n_up - r * down_blocks
        n0 = block * DOWN_N
        done = tl.atomic_add(sync_ptr + 1 + a, 0, sem="acquire", scope="gpu")
        while done < up_blocks:
            done = tl.atomic_add(sync_ptr + 1 + a, 0, sem="acquire", scope="gpu")
        h_row = h_ptr + a.to(tl.int64) * h_width
        if a < n_assign:
            t = a // TOP_K
            slot = a - t * TOP_K + 1
            out = _down_row_tma(h_row, d_desc, s2_ptr, tl.load(ids_ptr + a), tl.load(wts_ptr + a), n0, dim, inter,
                                FP8_D, SB_D, DOWN_N, DOWN_K, DOWN_STAGES)
        else:
            t = a - n_assign
            slot = 0
            out = _down_row_tma(h_row, ds_desc, ss2_ptr, 0, 1.0, n0, dim, inter_s, FP8_DS, SB_DS, DOWN_N, DOWN_K,
                                DOWN_STAGES)
        offs_n = n0 + tl.arange(0, DOWN_N)
        _split_store(y_ptr, part_ptr, ticket_ptr, out, t.to(tl.int64), slot, offs_n, offs_n < dim, dim, down_blocks,
                     TOP_K + 1, block)


def _descriptor(data: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor over expert weights [E, out, in] (or one expert's [out, in]) with tiles [1, BN, BK]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    data = data if data.dim() == 3 else data.unsqueeze(0)
    return TensorDescriptor.from_tensor(data, [1, block_n, block_k])


def _check_tiles(block_n: int, block_k: int, blocks: tuple) -> None:
    """A ValueError naming a TmaTiles value the kernel cannot take (`blocks`: the FP8 blocks, 0 if dense)."""
    if block_n & (block_n - 1) or block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"TmaTiles rows and steps must be powers of two (steps >= 16), got {block_n}, {block_k}")
    for sb in blocks:
        if sb and (sb % block_n or block_k % sb and sb % block_k):
            raise ValueError(f"TmaTiles rows {block_n} must divide the FP8 block {sb}, and steps {block_k} "
                             f"be a multiple or divisor of it")


def supported(x: torch.Tensor, *weights) -> bool:
    """Whether `tma_up` runs here: compute capability >= 9 (CPU: the Triton interpreter, tests), and every
    weight's rows and base 16-byte aligned, as a TMA descriptor needs."""
    if x.device.type == "cuda" and not sm90(x.device):
        return False
    parts = [_weight_parts(w)[0] for w in weights]
    return all(d.data_ptr() % 16 == 0 and d.stride(-2) * d.element_size() % 16 == 0 for d in parts)


def up_operands(x, ids, w1, w3, shared_w1, shared_w3, tickets: int):
    """The gate/up launch's operands (either kernel's): ((d1, s1, d3, s3, ds1, ss1, ds3, ss3) kernel arguments,
    (fp8, sb, fp8_s, sb_s), h [N·K + N, max(I, I_s)] fp32, the split down kernel's counters [N, tickets]
    int32 or None, and `decode_down`'s args (n_assign, D, I, I_s, h width, counters))."""
    n_tok, dim = x.shape
    n_assign = n_tok * ids.shape[1]
    (d1, s1, fp8, sb), (d3, s3, _, _) = _weight_parts(w1), _weight_parts(w3)
    (ds1, ss1, fp8_s, sb_s), (ds3, ss3, _, _) = _weight_parts(shared_w1), _weight_parts(shared_w3)
    inter, inter_s = d1.shape[1], ds1.shape[0]
    h_width = max(inter, inter_s)
    h = torch.empty((n_assign + n_tok, h_width), dtype=torch.float32, device=x.device)
    counters = torch.empty((n_tok, tickets), dtype=torch.int32, device=x.device) if tickets else None
    return ((d1, s1, d3, s3, ds1, ss1, ds3, ss3), (fp8, sb, fp8_s, sb_s), h, counters,
            (n_assign, dim, inter, inter_s, h_width, counters))


def tma_up(x, ids, w1, w3, shared_w1, shared_w3, swiglu_limit: float, tiles: TmaTiles = TmaTiles(),
           tickets: int = 0, early: bool = False):
    """`moe_decode.decode_up` through TMA (where `supported`): (h, args) in its form; `tickets` > 0: the
    split down kernel's counters [N, tickets] int32 (a power of two) zeroed here, else None. `early`: the
    shared experts' rows start before the previous launch ends (`_tma_up_kernel`'s EARLY; only where that
    launch is the router's, so that x was written before it: `moe_decode.decode_experts`' `x_ready`)."""
    return launch_up(x, ids, up_operands(x, ids, w1, w3, shared_w1, shared_w3, tickets), swiglu_limit, tiles,
                     tickets, early)


def launch_up(x, ids, operands: tuple, swiglu_limit: float, tiles: TmaTiles, tickets: int, early: bool = False):
    """`tma_up` on `up_operands`' result for the same x, ids and `tickets` (made once by `decode_up`)."""
    (d1, s1, d3, s3, ds1, ss1, ds3, ss3), (fp8, sb, fp8_s, sb_s), h, counters, args = operands
    _check_tiles(tiles.n, tiles.k, (sb if fp8 else 0, sb_s if fp8_s else 0))
    n_assign, dim, inter, inter_s, h_width, _ = args
    grid = (n_assign + x.shape[0], triton.cdiv(h_width, tiles.n))
    grid = (math.prod(grid),) if early else grid
    pdl = pdl_launch(x.device, math.prod(grid), early)
    descs = [_descriptor(d, tiles.n, tiles.k) for d in (d1, d3, ds1, ds3)]
    _tma_up_kernel[grid](
        x, ids, descs[0], descs[1], s1, s3, descs[2], descs[3], ss1, ss3, h, h if counters is None else counters,
        n_assign, dim, inter, inter_s, h_width, float(swiglu_limit), TOP_K=ids.shape[1], FP8=fp8, SB=sb,
        FP8_S=fp8_s, SB_S=sb_s, CLAMP=swiglu_limit > 0, BLOCK_N=tiles.n, BLOCK_K=tiles.k, STAGES=tiles.stages,
        TICKETS=tickets, EARLY=early, PDL=pdl, launch_pdl=pdl, num_warps=tiles.warps,
    )
    return h, args


def down_outputs(x: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A down launch's y [N, D] (x's dtype) and, split over programs, its fp32 parts [N, split, D]; unsplit
    the kernel never touches the parts (y stands in)."""
    y = torch.empty_like(x)
    return y, torch.empty((x.shape[0], split, x.shape[1]), dtype=torch.float32, device=x.device) if split > 1 else y


def tma_down(h, x, weights, ids, w2, shared_w2, args: tuple, tiles: TmaTiles = TmaTiles(), split: int = 1):
    """`moe_decode.decode_down` through TMA (where `supported`): y [N, D] in x.dtype from the up launch's h and
    args; `split` > 1 spreads each row block's K + 1 expert slots over that many programs (args must carry
    the up launch's ticket counters for at least ⌈D / tiles.n⌉ row blocks)."""
    return launch_down(h, x, weights, ids, (_weight_parts(w2), _weight_parts(shared_w2)), args, tiles, split)


def launch_down(h, x, weights, ids, parts: tuple, args: tuple, tiles: TmaTiles, split: int):
    """`tma_down` on the down weights' `_weight_parts` (W2's, then the shared W2's; `decode_down` has them)."""
    (d2, s2, fp8, sb), (ds2, ss2, fp8_s, sb_s) = parts
    n_assign, dim, inter, inter_s, h_width, tickets = args
    _check_tiles(tiles.n, tiles.k, (sb if fp8 else 0, sb_s if fp8_s else 0))
    top_k = ids.shape[1]
    n_blocks = triton.cdiv(dim, tiles.n)
    if not (isinstance(split, int) and 1 <= split <= top_k + 1):
        raise ValueError(f"tma_down split must be an int in 1..{top_k + 1} (the shared expert and {top_k} routed), "
                         f"got {split!r}")
    if split > 1 and (tickets is None or tickets.shape[1] < n_blocks):
        raise ValueError(f"tma_down with split {split} needs the up launch's tickets for {n_blocks} row blocks")
    y, part = down_outputs(x, split)
    grid = (x.shape[0], n_blocks, split)
    pdl = pdl_launch(x.device, math.prod(grid))
    _tma_down_kernel[grid](
        h, ids, weights, _descriptor(d2, tiles.n, tiles.k), s2, _descriptor(ds2, tiles.n, tiles.k), ss2, y, part,
        y if tickets is None else tickets, n_assign, dim, inter, inter_s, h_width,
        0 if tickets is None else tickets.shape[1], TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), FP8=fp8,
        SB=sb, FP8_S=fp8_s, SB_S=sb_s, BLOCK_N=tiles.n, BLOCK_K=tiles.k, STAGES=tiles.stages, SPLIT=split,
        PDL=pdl, launch_pdl=pdl, num_warps=tiles.warps,
    )
    return y


def fused_counters(x: torch.Tensor, top_k: int, down: TmaTiles) -> torch.Tensor:
    """`tma_fused`'s counters for x [N, D] with top-k routing and down items of `down.n` rows, zeroed: the item
    counter, each work row's done count and the tickets of every (token, row block of D). [1 + N·(K + 1) +
    N·⌈D / down.n⌉] int32."""
    n_tok, dim = x.shape
    return torch.zeros(1 + n_tok * (top_k + 1) + n_tok * triton.cdiv(dim, down.n), dtype=torch.int32, device=x.device)


def tma_fused(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit: float,
              up: TmaTiles = TmaTiles(), down: TmaTiles = TmaTiles(16, 256, 4, 4), counters=None):
    """`moe_decode.decode_experts` as one launch (`_tma_fused_kernel`, where `supported`): y [N, D] in x.dtype.
    `up` / `down`: the gate/up and down items' tiles; the launch runs max(up.warps, down.warps) warps.
    `counters`: `fused_counters(x, K, down)`, zeroed before the router launched, the router being the launch
    right before this one and launched after x was written (`moe_decode.decode_experts`' `x_ready`): the
    EARLY form, the shared rows' gate/up items streaming while the router runs. None: counters made here
    (a memset right before the launch), no EARLY."""
    operands = up_operands(x, ids, w1, w3, shared_w1, shared_w3, 0)
    (d1, s1, d3, s3, ds1, ss1, ds3, ss3), (fp8, sb, fp8_s, sb_s), h, _, args = operands
    n_assign, dim, inter, inter_s, h_width, _ = args
    d2, s2, fp8_d, sb_d = _weight_parts(w2)
    ds2, ss2, fp8_ds, sb_ds = _weight_parts(shared_w2)
    _check_tiles(up.n, up.k, (sb if fp8 else 0, sb_s if fp8_s else 0))
    _check_tiles(down.n, down.k, (sb_d if fp8_d else 0, sb_ds if fp8_ds else 0))
    n_tok, top_k = ids.shape
    up_blocks, down_blocks = triton.cdiv(h_width, up.n), triton.cdiv(dim, down.n)
    n_rows = n_assign + n_tok
    early = counters is not None
    sync = counters if early else fused_counters(x, top_k, down)  # zeroed for this call (the kernel uses them up)
    if early and (sync.dtype != torch.int32 or sync.shape != (1 + n_rows + n_tok * down_blocks,)
                  or sync.device != x.device):
        raise ValueError(f"tma_fused counters must be fused_counters(x, {top_k}, down): int32 "
                         f"[{1 + n_rows + n_tok * down_blocks}] on {x.device}, got {sync.dtype} "
                         f"{list(sync.shape)} on {sync.device}")
    y, part = down_outputs(x, top_k + 1)
    grid = (n_rows * (up_blocks + down_blocks),)
    pdl = pdl_launch(x.device, math.prod(grid), early)
    descs = [_descriptor(d, up.n, up.k) for d in (d1, d3, ds1, ds3)]
    _tma_fused_kernel[grid](
        x, ids, weights, descs[0], descs[1], s1, s3, descs[2], descs[3], ss1, ss3, _descriptor(d2, down.n, down.k),
        s2, _descriptor(ds2, down.n, down.k), ss2, h, y, part, sync, sync[1 + n_rows:], n_assign, dim, inter, inter_s,
        h_width, float(swiglu_limit), up_blocks, down_blocks, TOP_K=top_k, FP8=fp8, SB=sb, FP8_S=fp8_s, SB_S=sb_s,
        FP8_D=fp8_d, SB_D=sb_d, FP8_DS=fp8_ds, SB_DS=sb_ds, CLAMP=swiglu_limit > 0, UP_N=up.n, UP_K=up.k,
        UP_STAGES=up.stages, DOWN_N=down.n, DOWN_K=down.k, DOWN_STAGES=down.stages, EARLY=early, PDL=pdl,
        launch_pdl=pdl, num_warps=max(up.warps, down.warps),
    )
    return y
