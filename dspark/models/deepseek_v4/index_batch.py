"""Lightning-indexer scores of several requests in one padded pass (V4 and V4.1 index sources).

The registry's `lightning_indexer` op scores the rows of ONE request against that request's keys.
A ragged decode / verify call has B requests with B different key sets; instead of B op calls the
rows are padded to [B, S_max] and the keys to [B, T_max] and scored by the registry's
`index_scores` (one group per request; its reference is `indexer_scores_ref`'s formula):

    I[s, t] = Σ_h w[s, h] · ReLU(q[s, h] · κ_t)        fp32, κ = keys of the row's own request

−inf where t ≥ the row's visible count, which never exceeds its request's T_b, so padding is never
picked. Callers select with the registry's `select_topk` (ref: `select_topk_ref`), so picks and ties
follow the op's definition.

Shape symbols: N rows of the call, B requests, S_max / T_max the most rows / keys of a request,
Hi / di index heads / head dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from dspark.kernels.indexer_ref import index_scores_ref
from dspark.models.deepseek_v4.state import RaggedBatch

def pads_well(batch: RaggedBatch) -> bool:
    """Whether a padded pass suits the call: several requests, padding at most half the rows
    (decode and verify calls; a long prompt among decode rows is scored per request)."""
    return len(batch.seq_lens) > 1 and max(batch.seq_lens) * len(batch.seq_lens) <= 2 * sum(batch.seq_lens)


def padded_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: list[torch.Tensor], batch: RaggedBatch,
                        visible: torch.Tensor, scores_op: Callable = index_scores_ref, **op_kwargs):
    """Scores of every row against its own request's keys, −inf where t ≥ visible[row].

    Shape: q [N, Hi, di] rotated index queries; weights [N, Hi] head weights (constants folded in);
    keys one [T_b, di] per request; visible [N] entries each row may see (≤ T_b, so a request's
    padding never scores); `scores_op` the registry's `index_scores` (one group per request).
    Returns [N, T_max] fp32. With the registry's `index_scores_pooled` as `scores_op` (and its
    `block=` in op_kwargs): (scores [N, T_max], the V4.1 pool's block scores [N, ceil(T_max / block)]).
    """
    n_req, seq_max, t_max = len(keys), max(batch.seq_lens), max(k.shape[0] for k in keys)
    slot = _padded_slots(batch, seq_max).to(q.device, non_blocking=True)  # [N] row -> b·S_max + s
    rows = torch.zeros(n_req * seq_max, dtype=torch.long, device=q.device).index_copy_(
        0, slot, torch.arange(q.shape[0], device=q.device))  # padded slot -> row (padding: row 0)
    q_pad = q[rows].unflatten(0, (n_req, seq_max))  # [B, S_max, Hi, di]
    w_pad = weights[rows].unflatten(0, (n_req, seq_max))  # [B, S_max, Hi]
    v_pad = visible[rows].unflatten(0, (n_req, seq_max))  # [B, S_max]
    k_pad = _pad_keys(keys, t_max)  # [B, T_max, di]
    out = scores_op(q_pad, w_pad, k_pad, v_pad, **op_kwargs)  # [B, S_max, ...] each
    if isinstance(out, torch.Tensor):
        return out.flatten(0, 1)[slot]  # [N, T_max]
    return tuple(t.flatten(0, 1)[slot] for t in out)


def _padded_slots(batch: RaggedBatch, seq_max: int) -> torch.Tensor:
    """[N] (host) slot b·S_max + s of row s of request b in the [B, S_max] padded layout."""
    lens = torch.tensor(batch.seq_lens)
    request = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first = torch.repeat_interleave(torch.tensor(batch.offsets), lens)
    return request * seq_max + torch.arange(sum(batch.seq_lens)) - first


def _pad_keys(keys: list[torch.Tensor], t_max: int) -> torch.Tensor:
    """Per-request keys [T_b, di] -> [B, T_max, di]: one concatenation and one gather (a padded
    slot repeats the request's last key, or any key when it has none: padding is masked anyway)."""
    lens = [k.shape[0] for k in keys]
    flat = torch.cat(keys)  # [ΣT, di]
    host = torch.tensor([list(itertools.accumulate(lens[:-1], initial=0)), lens])  # [2, B] (first row, T_b)
    first, n = host.to(flat.device, non_blocking=True)
    last = (first + n - 1).clamp(0, flat.shape[0] - 1)  # [B]
    rows = torch.minimum(first.unsqueeze(-1) + torch.arange(t_max, device=flat.device), last.unsqueeze(-1))
    return flat[rows]
