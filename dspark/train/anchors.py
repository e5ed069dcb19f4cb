"""Anchors and training blocks (dspark spec §5.3–5.5).

For a sequence x_0..x_{L−1} with loss mask m, an anchor a is a response position whose next token is
a response token too (m[a] = m[a+1] = 1, a ≤ L−2). Up to `num_anchors` of them are drawn uniformly
without replacement and sorted. The block of anchor a mirrors one inference round (spec §1.3, §2.2):

    block input    [x_a, noise × (γ−1)]            at positions a .. a+γ−1
    label of k     x*_k = x_{a+k+1}                (slot k predicts position a+k+1: §11 pitfall 1)
    teacher of k   target logits row a+k           (its own next-token distribution, true prefix)
    previous of k  x_{a+k} (= x_a, x*_0, .., x*_{γ−2}): the Markov / confidence input, teacher-forced
    context        target rows a−W .. a−1          (strictly before the anchor: §11 pitfall 2)

Slot k is supervised only while every label up to k exists and is a response token (`eval_mask`, a
contiguous valid prefix), weighted by exp(−k/g) with g = 4 for γ = 7 (scaled γ·4/7 otherwise, §5.5).

Shape symbols: L sequence length, N blocks, γ block size, W window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark.draft.context import window_rows


@dataclass(frozen=True)
class AnchorBlocks:
    """N training blocks of one sequence (module docstring). Index tensors are clamped into the
    sequence, so out-of-range slots point at valid rows; their `weights` are 0.

    anchors [N]; input_ids, positions, labels, prev, teacher_rows, weights [N, γ] (weights fp32).
    pool_offset [N] or None: row of the block's sequence start in a key pool that holds several
    sequences one after another (`concat_blocks`); None for a single sequence (offset 0).
    """

    anchors: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    teacher_rows: torch.Tensor
    weights: torch.Tensor
    pool_offset: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[0])


def default_decay(gamma: int) -> float:
    """g of the position weights exp(−k/g): 4 at γ = 7 (every released config), scaled with γ."""
    return 4.0 * gamma / 7.0


def position_weights(gamma: int, decay: float | None = None) -> torch.Tensor:
    """fp32 [γ], w_k = exp(−k/g) for slots k = 0..γ−1."""
    g = default_decay(gamma) if decay is None else decay
    if not (isinstance(g, (int, float)) and math.isfinite(g) and g > 0):
        raise ValueError(f"decay must be a finite number > 0, got {g!r}")
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / g)


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """LongTensor [n] of positions a with m[a] = m[a+1] = 1."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `num_anchors` candidates, uniformly without replacement, sorted: LongTensor [N]."""
    candidates = candidate_anchors(loss_mask)
    if candidates.numel() <= num_anchors:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, gamma: int,
                 noise_token_id: int, decay: float | None = None) -> AnchorBlocks:
    """The training blocks of `anchors` in the sequence input_ids [L] with loss_mask [L]."""
    length = input_ids.shape[0]
    k = torch.arange(gamma)
    rows = anchors[:, None] + k  # [N, γ] positions a+k: the slot positions and teacher rows
    label_pos = rows + 1
    inside = label_pos < length
    valid = inside & loss_mask.bool()[label_pos.clamp(max=length - 1)]
    eval_mask = torch.cumprod(valid.long(), dim=1).bool()  # a contiguous valid prefix only
    labels = input_ids[label_pos.clamp(max=length - 1)]
    block = torch.full((anchors.shape[0], gamma), noise_token_id, dtype=torch.long)
    block[:, 0] = input_ids[anchors]
    return AnchorBlocks(
        anchors=anchors, input_ids=block, positions=rows, labels=labels,
        prev=input_ids[rows.clamp(max=length - 1)], teacher_rows=rows.clamp(max=length - 1),
        weights=position_weights(gamma, decay)[None, :] * eval_mask.float(),
    )


def context_index(anchors: torch.Tensor, window: int, pool_offset: torch.Tensor | None = None) -> torch.Tensor:
    """[N, W] rows of a key pool visible to each anchor's block: positions a−W .. a−1 of its own
    sequence, −1 before 0. The pool holds one sequence (row = position) or several laid end to end,
    sequence b starting at row pool_offset[n]. Same order as at inference (`dspark.draft.context`)."""
    zeros = torch.zeros_like(anchors)
    return window_rows(anchors, window, zeros, zeros if pool_offset is None else pool_offset)


def concat_blocks(groups: list[AnchorBlocks], lengths: list[int]) -> AnchorBlocks:
    """The blocks of several sequences as one group over their concatenation (sequence b of length
    lengths[b] starts at row Σ lengths[:b]): teacher rows move to the concatenated rows, positions stay
    per sequence (they are RoPE positions), and `pool_offset` keeps each block's context inside its
    own sequence. One drafter call then covers a whole optimizer step instead of one per sequence."""
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    return AnchorBlocks(
        anchors=torch.cat([g.anchors for g in groups]),
        input_ids=torch.cat([g.input_ids for g in groups]),
        positions=torch.cat([g.positions for g in groups]),
        labels=torch.cat([g.labels for g in groups]),
        prev=torch.cat([g.prev for g in groups]),
        teacher_rows=torch.cat([g.teacher_rows + s for g, s in zip(groups, starts)]),
        weights=torch.cat([g.weights for g in groups]),
        pool_offset=torch.cat([torch.full_like(g.anchors, s) for g, s in zip(groups, starts)]),
    )
