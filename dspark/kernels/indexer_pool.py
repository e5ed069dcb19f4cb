"""V4.1 hierarchical candidate pool (deepseek_v41 spec §5.4, `select_candidate_blocks`): the block
pooling and block top-k of the candidate source's masked index scores, as one op.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``indexer_pool(scores, visible, *, topk_blocks, block, bscores=None) -> keep``: block score = max
  of `block` consecutive entries (the row right-padded with −inf); the block holding the query's
  newest visible entry, (visible − 1) // block, is pinned to +inf; the best `topk_blocks` blocks with
  a score above −inf are kept; keep marks their entries. Ties between equal block scores: the lower
  block id wins (the indexer's rule, `indexer_ref.py`), so the op is deterministic. `bscores`: those
  block scores computed already (`index_scores_pooled`), used as given (no pass over `scores`).
* ``index_scores_pooled(q, weights, keys, visible, *, block) -> (scores, bscores)``: `index_scores`
  ([B, S, T] fp32) and the pool's block scores of its rows ([B, S, ceil(T / block)] fp32, the same
  `visible` pinning), for `indexer_pool(..., bscores=)`. The maxima of fp32 scores are exact, so the
  pool is the unfused one's bit for bit.

The consumers (later index sources) pass `keep` to `lightning_indexer`, whose score kernel applies
it as −inf before its own top-k: that is where the pool masking is fused.

Shape symbols: S query rows, T entries, B = ceil(T / block) blocks.

Fused kernels, two launches:

1. `_block_max_kernel`, grid (S, block tiles): block maxima and the pin -> [S, B] fp32 (a scratch
   eighth of the score matrix for block 8). Skipped when `bscores` is given: `index_scores_pooled`
   writes them in `indexer._score_kernel`'s epilogue (POOL_B; blocks that are a power of two up to
   the key tile, as V4.1's 8; other blocks: its scores, then this kernel), saving a launch and a
   read of the [S, T] fp32 scores.
2. `_pool_select_kernel`, one program per row: the block top-k threshold by the indexer's radix
   search (`indexer._kth_largest`, same tie rule), then one pass over the blocks in id order that
   writes every entry of the row's mask (kept blocks expanded to their entries).

No host sync, buffers sized from shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark.kernels.indexer import (_REGISTER_ROW, _STREAM_TILE, RADIX_BITS, _kth_largest, _order_keys, _take_flags,
                                    launch_index_scores, pool_block_fits)
from dspark.kernels.indexer_ref import _check_index_scores_args, index_scores_ref
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_args(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int,
                bscores: torch.Tensor | None = None) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [S, T], got {tuple(scores.shape)} {scores.dtype}")
    if tuple(visible.shape) != (scores.shape[0],) or visible.dtype.is_floating_point:
        raise ValueError(f"visible must be an integer [S={scores.shape[0]}] tensor, "
                         f"got {tuple(visible.shape)} {visible.dtype}")
    _check_positive(topk_blocks=topk_blocks, block=block)
    if bscores is not None:
        want = (scores.shape[0], -(-scores.shape[1] // block))
        if tuple(bscores.shape) != want or bscores.dtype != torch.float32:
            raise ValueError(f"bscores must be float32 [S, B] = {want}, got {tuple(bscores.shape)} {bscores.dtype}")


def _block_scores_ref(scores: torch.Tensor, visible: torch.Tensor, block: int) -> torch.Tensor:
    """[S, T] scores -> [S, B] block maxima with the newest visible entry's block pinned to +inf."""
    blocks = F.pad(scores, (0, -scores.shape[-1] % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)
    newest = ((visible - 1) // block).unsqueeze(-1)  # −1 (matches nothing) when nothing is visible
    ids = torch.arange(blocks.shape[-1], device=scores.device)
    return blocks.masked_fill(ids == newest, float("inf"))


def indexer_pool_ref(scores: torch.Tensor, visible: torch.Tensor, *, topk_blocks: int, block: int,
                     bscores: torch.Tensor | None = None) -> torch.Tensor:
    """Candidate pool of the candidate source (spec §5.4).

    Shape: scores [S, T] fp32, the source's masked index scores (−inf = unreachable); visible [S]
    int, entries each query sees. topk_blocks = B_top (2048 released), block = b (8 released).
    bscores [S, B] fp32: the block scores of `scores` (`index_scores_pooled`), or None to compute them.
    Returns keep [S, T] bool, True on the entries of the kept blocks.
    """
    _check_args(scores, visible, topk_blocks, block, bscores)
    blocks = _block_scores_ref(scores, visible, block) if bscores is None else bscores
    order = torch.sort(blocks, dim=-1, descending=True, stable=True)  # ties: lower block id first
    k = min(topk_blocks, blocks.shape[-1])
    kept = order.values[:, :k] > float("-inf")
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, order.indices[:, :k], kept)
    return keep.repeat_interleave(block, dim=-1)[:, :scores.shape[-1]]


def index_scores_pooled_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, *,
                            block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`index_scores_ref` and the pool's block scores of its rows.

    Shape: q [B, S, Hi, di], weights [B, S, Hi], keys [B, T, di], visible [B, S] int (as
    `index_scores_ref`); block = b. Returns (scores [B, S, T] fp32, bscores [B, S, ceil(T / b)] fp32:
    block maxima, the block of entry visible − 1 pinned to +inf), what `indexer_pool` computes from
    the scores.
    """
    _check_positive(block=block)
    scores = index_scores_ref(q, weights, keys, visible)
    bscores = _block_scores_ref(scores.flatten(0, 1), visible.flatten(), block)
    return scores, bscores.view(*scores.shape[:2], -1)


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _block_max_kernel(score_ptr, vis_ptr, out_ptr, n_keys, n_blocks, block,
                      BLOCK_B: tl.constexpr, B_PAD: tl.constexpr, PDL: tl.constexpr):
    """out[s, b] for row s = program_id(0) and blocks b of tile program_id(1)."""
    pdl_prologue(PDL)
    s = tl.program_id(0).to(tl.int64)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_j = tl.arange(0, B_PAD)
    ids = offs_b[:, None] * block + offs_j[None, :]  # [BLOCK_B, B_PAD] entry ids
    ok = (offs_b[:, None] < n_blocks) & (offs_j[None, :] < block) & (ids < n_keys)
    best = tl.max(tl.load(score_ptr + s * n_keys + ids, mask=ok, other=float("-inf")), axis=1)
    vis = tl.load(vis_ptr + s)
    newest = tl.where(vis > 0, (vis - 1) // block, -1)  # Triton's // truncates: (0 − 1) // b would be 0
    best = tl.where(offs_b == newest, float("inf"), best)
    tl.store(out_ptr + s * n_blocks + offs_b, best, mask=offs_b < n_blocks)


@_jit
def _pool_select_kernel(bscore_ptr, keep_ptr, n_keys, n_blocks, block, topk,
                        ONE_TILE: tl.constexpr, BLOCK_T: tl.constexpr, WRITE_T: tl.constexpr, B_PAD: tl.constexpr,
                        RADIX_BITS: tl.constexpr, PDL: tl.constexpr):
    """keep[s, :] of row s = program_id(0): 1 on the entries of its top-k blocks, 0 elsewhere.
    The threshold search keeps the row in registers when it fits (ONE_TILE); the write pass walks
    [WRITE_T, B_PAD] entry tiles, small enough that the expanded tile stays in registers."""
    pdl_prologue(PDL)
    s = tl.program_id(0).to(tl.int64)
    row_ptr = bscore_ptr + s * n_blocks
    offs = tl.arange(0, BLOCK_T)
    keys = offs  # bound on both paths for the compiler; only the one-tile path reads it
    if ONE_TILE:
        keys = _order_keys(tl.load(row_ptr + offs, mask=offs < n_blocks, other=float("-inf")))
    theta, n_take, n_ties = _kth_largest(row_ptr, n_blocks, keys, keys, topk, ONE_TILE, BLOCK_T, 0, RADIX_BITS)
    offs_w = tl.arange(0, WRITE_T)
    offs_j = tl.arange(0, B_PAD)
    ties_seen = tl.full((), 0, tl.int32)
    for b0 in range(0, n_blocks, WRITE_T):
        ids = b0 + offs_w
        in_row = ids < n_blocks
        tile = _order_keys(tl.load(row_ptr + ids, mask=in_row, other=float("-inf")))
        take, ties_seen = _take_flags(tile, in_row, theta, n_ties, ties_seen)
        entries = ids[:, None] * block + offs_j[None, :]  # [WRITE_T, B_PAD]
        ok = in_row[:, None] & (offs_j[None, :] < block) & (entries < n_keys)
        flags = tl.broadcast_to(take[:, None], (WRITE_T, B_PAD)).to(tl.int8)
        tl.store(keep_ptr + s * n_keys + entries, flags, mask=ok)


# ------------------------------------------------------------------------------------- launcher


def indexer_pool(scores: torch.Tensor, visible: torch.Tensor, *, topk_blocks: int, block: int,
                 bscores: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `indexer_pool_ref` (same signature, shapes, dtypes and tie rule)."""
    require_triton()
    _check_args(scores, visible, topk_blocks, block, bscores)
    n_q, n_keys = scores.shape
    keep = torch.empty((n_q, n_keys), dtype=torch.bool, device=scores.device)
    if n_q == 0 or n_keys == 0:
        return keep
    n_blocks = triton.cdiv(n_keys, block)
    b_pad = triton.next_power_of_2(block)
    if bscores is None:
        bscores = torch.empty((n_q, n_blocks), dtype=torch.float32, device=scores.device)
        _launch_block_max(scores.contiguous(), visible.contiguous(), bscores, block)
    one_tile = n_blocks <= _REGISTER_ROW
    tile = max(16, triton.next_power_of_2(n_blocks)) if one_tile else _STREAM_TILE
    pdl = pdl_launch(scores.device, n_q)
    _pool_select_kernel[(n_q,)](bscores.contiguous(), keep.view(torch.int8), n_keys, n_blocks, block,
                                min(topk_blocks, n_blocks), ONE_TILE=one_tile, BLOCK_T=tile,
                                WRITE_T=max(16, 2048 // b_pad), B_PAD=b_pad, RADIX_BITS=RADIX_BITS, PDL=pdl,
                                launch_pdl=pdl, num_warps=8 if tile >= 2048 else 4)
    return keep


def _launch_block_max(scores: torch.Tensor, visible: torch.Tensor, bscores: torch.Tensor, block: int) -> None:
    """`_block_max_kernel` over contiguous scores [S, T] fp32 and visible [S] into bscores [S, B]."""
    n_q, n_keys = scores.shape
    n_blocks = bscores.shape[1]
    b_pad = triton.next_power_of_2(block)
    block_b = max(1, 1024 // b_pad)  # ~1024 entries per program
    grid = (n_q, triton.cdiv(n_blocks, block_b))
    pdl = pdl_launch(scores.device, math.prod(grid))
    _block_max_kernel[grid](
        scores, visible, bscores, n_keys, n_blocks, block, BLOCK_B=block_b, B_PAD=b_pad, PDL=pdl, launch_pdl=pdl)


def index_scores_pooled(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, *,
                        block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `index_scores_pooled_ref` (same signature, shapes and dtypes; the block scores bit for bit
    those of its own scores): one `_score_kernel` launch that writes both when a key tile holds
    whole blocks (`indexer.pool_block_fits`), else the scores, then `_block_max_kernel`."""
    require_triton()
    _check_index_scores_args(q, weights, keys, visible)
    _check_positive(block=block)
    n_groups, n_q, n_heads, head_dim = q.shape
    n_keys = keys.shape[1]
    scores = torch.empty((n_groups, n_q, n_keys), dtype=torch.float32, device=q.device)
    bscores = torch.empty((n_groups, n_q, triton.cdiv(n_keys, block)), dtype=torch.float32, device=q.device)
    if scores.numel() == 0:
        return scores, bscores
    if pool_block_fits(block, n_heads, head_dim):
        launch_index_scores(q, weights, keys, visible, scores, bscores, block)
    else:
        launch_index_scores(q, weights, keys, visible, scores)
        _launch_block_max(scores.view(-1, n_keys), visible.reshape(-1).contiguous(),
                          bscores.view(-1, bscores.shape[-1]), block)
    return scores, bscores
