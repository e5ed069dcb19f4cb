"""Torch reference of `lightning_indexer` (see `indexer.py` for the op and its fused kernels).

Kept apart from the kernel module so that the models import it without importing Triton.

Tie rule (shared with the kernel, part of the op's definition): entries are ranked by score,
descending, and equal scores by entry id, ascending -- the older entry wins. So the picks are the
first k entries of a *stable* descending sort of the score row. ReLU makes exact ties common
(every head's dot product negative gives a score of exactly 0), so the rule decides real picks.
"""

from __future__ import annotations

import torch


def _check_args(q, weights, keys, visible, candidates, topk) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [S, Hi, di], got shape {tuple(q.shape)}")
    n_q, n_heads, head_dim = q.shape
    if tuple(weights.shape) != (n_q, n_heads):
        raise ValueError(f"weights must be [S={n_q}, Hi={n_heads}], got {tuple(weights.shape)}")
    if keys.dim() != 2 or keys.shape[1] != head_dim:
        raise ValueError(f"keys must be [T, di={head_dim}], got {tuple(keys.shape)}")
    if tuple(visible.shape) != (n_q,) or visible.dtype.is_floating_point:
        raise ValueError(f"visible must be an integer [S={n_q}] tensor, got {tuple(visible.shape)} {visible.dtype}")
    if candidates is not None and (tuple(candidates.shape) != (n_q, keys.shape[0]) or candidates.dtype != torch.bool):
        raise ValueError(f"candidates must be a bool [S={n_q}, T={keys.shape[0]}] tensor or None, "
                         f"got {tuple(candidates.shape)} {candidates.dtype}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                       candidates: torch.Tensor | None) -> torch.Tensor:
    """I[s, t] = Σ_h weights[s, h] · ReLU(q[s, h] · keys[t]) in fp32; −inf where t ≥ visible[s] or
    (with `candidates`) outside the pool. Shapes as `lightning_indexer_ref`; returns [S, T] fp32."""
    dots = torch.einsum("shd,td->sht", q.float(), keys.float()).relu_()  # [S, Hi, T]
    scores = torch.bmm(weights.float().unsqueeze(1), dots).squeeze(1)  # [S, T]
    reachable = torch.arange(keys.shape[0], device=q.device) < visible.unsqueeze(-1)
    if candidates is not None:
        reachable = reachable & candidates
    return scores.masked_fill(~reachable, float("-inf"))


def check_select_args(scores: torch.Tensor, topk: int, offset: torch.Tensor | None,
                      out: torch.Tensor | None) -> None:
    """Validate `select_topk`'s arguments (shared by the kernel and the reference)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [S, T], got {scores.dtype} {tuple(scores.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    n_q, n_out = scores.shape[0], min(topk, scores.shape[1])
    if offset is not None and (offset.dtype != torch.int64 or offset.numel() != n_q or offset.dim() not in (1, 2)):
        raise ValueError(f"offset must be int64 [S] or [S, 1] with S={n_q}, got {offset.dtype} {tuple(offset.shape)}")
    if out is not None and (out.dtype != torch.int64 or tuple(out.shape) != (n_q, n_out) or out.stride(1) != 1):
        raise ValueError(f"out must be int64 [S, min(k, T)] = [{n_q}, {n_out}] with contiguous rows, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")


def select_topk_ref(scores: torch.Tensor, topk: int, *, offset: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, T] fp32 scores (−inf = unreachable) -> [S, min(k, T)] int64 ids of the best reachable
    entries under the tie rule above, ascending by id, −1 padded at the end.

    `offset` [S] or [S, 1] int64 is added to every id (not to the −1s): the picks as rows of a pool
    whose entry 0 sits at `offset` (the V4 static step's key list). `out` [S, min(k, T)] int64 (rows
    may be strided, e.g. the tail of the key list after the window) receives them and is returned."""
    check_select_args(scores, topk, offset, out)
    n_keys = scores.shape[-1]
    k = min(topk, n_keys)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)  # ties: lower id first
    best, ids = order.values[:, :k], order.indices[:, :k]
    ids = torch.where(best > float("-inf"), ids, n_keys).sort(dim=-1).values  # ascending, misses last
    missing = ids == n_keys
    if offset is not None:
        ids = ids + offset.view(-1, 1)
    ids = ids.masked_fill(missing, -1)
    return ids if out is None else out.copy_(ids)


def lightning_indexer_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                          candidates: torch.Tensor | None, *, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning-indexer scores and top-k of decode / verify / prefill rows over compressed keys
    (deepseek_v4 spec §8.4, deepseek_v41 spec §5.3-§5.4).

    Shape: q [S, Hi, di] rotated index queries (model dtype); weights [S, Hi] fp32 head weights with
    every constant folded in (V4: ω·Hi^-1/2·di^-1/2, V4.1: ω·(Hi·di)^-1/2); keys [T, di] index keys;
    visible [S] int, query s may pick entries t < visible[s]; candidates [S, T] bool or None, the
    V4.1 candidate pool (entries outside it are never picked); topk = k.

    Returns (ids [S, min(k, T)] int64 ascending by id, −1 padded; scores [S, T] fp32 with −inf on
    unreachable entries, which the V4.1 candidate source pools into blocks).
    """
    _check_args(q, weights, keys, visible, candidates, topk)
    scores = indexer_scores_ref(q, weights, keys, visible, candidates)
    return select_topk_ref(scores, topk), scores


# Groups scored at once are chunked so that the [b, S, Hi, T] fp32 product stays below this many elements.
_CHUNK_ELEMENTS = 1 << 26


def grouped_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores of B groups of queries, each against its own keys: the core of `padded_index_scores`,
    and the reference of `index_scores` (one group per static slot) before its visibility mask.

    Shape: q [B, S, Hi, di], weights [B, S, Hi], keys [B, T, di] (fp32 or model dtype; the math
    runs in fp32). Returns [B, S, T] fp32. Shapes alone decide the chunking: no host sync.
    """
    q, weights, keys = q.float(), weights.float(), keys.float()
    n_groups, seq, n_heads = weights.shape
    chunk = max(1, _CHUNK_ELEMENTS // (seq * n_heads * max(keys.shape[1], 1)))
    scores = []
    for i in range(0, n_groups, chunk):
        dots = torch.einsum("bshd,btd->bsht", q[i : i + chunk], keys[i : i + chunk]).relu_()
        scores.append(torch.matmul(weights[i : i + chunk].unsqueeze(-2), dots).squeeze(-2))  # [b, S, T]
    return torch.cat(scores) if len(scores) > 1 else scores[0]


def _check_index_scores_args(q, weights, keys, visible) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S, Hi, di], got shape {tuple(q.shape)}")
    n_groups, seq, n_heads, head_dim = q.shape
    if tuple(weights.shape) != (n_groups, seq, n_heads):
        raise ValueError(f"weights must be [B={n_groups}, S={seq}, Hi={n_heads}], got {tuple(weights.shape)}")
    if keys.dim() != 3 or keys.shape[0] != n_groups or keys.shape[2] != head_dim:
        raise ValueError(f"keys must be [B={n_groups}, T, di={head_dim}], got {tuple(keys.shape)}")
    if tuple(visible.shape) != (n_groups, seq) or visible.dtype.is_floating_point:
        raise ValueError(f"visible must be an integer [B={n_groups}, S={seq}] tensor, got "
                         f"{tuple(visible.shape)} {visible.dtype}")


def index_scores_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Indexer scores of B groups of rows, each against its own keys, masked by visibility: the static
    decode steps' scoring (one group per slot).

    Shape: q [B, S, Hi, di], weights [B, S, Hi], keys [B, T, di], visible [B, S] int (entries t <
    visible are reachable). Returns [B, S, T] fp32: Σ_h weights · ReLU(q · keys) (`grouped_index_scores`),
    −inf where t ≥ visible.
    """
    _check_index_scores_args(q, weights, keys, visible)
    scores = grouped_index_scores(q, weights, keys)
    unreachable = torch.arange(keys.shape[1], device=q.device) >= visible.unsqueeze(-1)
    return scores.masked_fill(unreachable, float("-inf"))
