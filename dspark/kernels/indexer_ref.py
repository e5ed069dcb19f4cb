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


def select_topk_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[S, T] fp32 scores (−inf = unreachable) -> [S, min(k, T)] int64 ids of the best reachable
    entries under the tie rule above, ascending by id, −1 padded at the end."""
    n_keys = scores.shape[-1]
    k = min(topk, n_keys)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)  # ties: lower id first
    best, ids = order.values[:, :k], order.indices[:, :k]
    ids = torch.where(best > float("-inf"), ids, n_keys).sort(dim=-1).values  # ascending, misses last
    return ids.masked_fill(ids == n_keys, -1)


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
