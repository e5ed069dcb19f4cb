"""Prefill modes of DeepSeek-V4.1 (deepseek_v41 spec §6): `exact` and `bounded_replay`.

CED (§6.1): every global entry of every layer is a function of the "encoder" layers before the
split layer s (the last KV source: 20 in Flash) and of s's own global projections. Past the
split, what still depends on decoder hidden states is only each decoder layer's sliding window.

exact            every row of a call runs through every layer (the reference; what the official
                 inference code does).
bounded_replay   (§6.2) for a request whose call brings n > W rows (W = sliding_window, 128 in
                 Flash): layers < s and s's global projections (compressor, index keys) run on all
                 n rows; the decoder (layers >= s: queries, indexers, windows, MoE, mHC) runs only
                 on the last W rows, each decoder window restarted at their first position (the
                 "SWA read floor"). Calls with n <= W per request are computed exactly as in exact
                 mode, so bounded replay equals exact for every prompt of at most W tokens and for
                 decode and verify calls. Longer prompts drift: the replayed rows' decoder windows
                 miss the decoder state of earlier rows (§6.2 "why approximate"); global KV and all
                 encoder state are identical to exact mode. A replaying call cannot be rewound
                 (its end becomes the rewind floor), and its output rows before the replayed ones
                 are NaN (`DeepseekV41Output.valid` marks the computed rows).

With chunked prefill every chunk longer than W replays its own last W rows, so chunking changes
the result (each chunk's decoder tail is kept); single-chunk prefill is exactly spec §6.2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.deepseek_v4.state import RaggedBatch

EXACT = "exact"
BOUNDED_REPLAY = "bounded_replay"
PREFILL_MODES = (EXACT, BOUNDED_REPLAY)


@dataclass(frozen=True)
class ReplayPlan:
    """Which rows of a call the decoder layers run on.

    rows     [M] long, indices into the call's N rows (per request, its last min(n_b, W) rows)
    batch    the `RaggedBatch` of those rows (starts = first replayed position per request)
    skipped  per request: whether rows were skipped (its decoder windows restart, no rewind)
    """

    rows: torch.Tensor
    batch: RaggedBatch
    skipped: tuple[bool, ...]

    def floor(self, b: int) -> int:
        """Absolute position of request b's first replayed row (its decoder windows' new start)."""
        return self.batch.starts[b]


def plan_replay(batch: RaggedBatch, window: int) -> ReplayPlan | None:
    """Bounded-replay rows of a call, or None when no request brings more than `window` rows."""
    keep = tuple(min(n, window) for n in batch.seq_lens)
    if keep == batch.seq_lens:
        return None
    device = batch.positions.device
    rows = torch.cat([torch.arange(off + n - k, off + n, device=device)
                      for off, n, k in zip(batch.offsets, batch.seq_lens, keep)])
    offsets = tuple(sum(keep[:b]) for b in range(len(keep)))
    starts = tuple(s + n - k for s, n, k in zip(batch.starts, batch.seq_lens, keep))
    sub = RaggedBatch(batch.input_ids[rows], batch.positions[rows], keep, offsets, starts)
    return ReplayPlan(rows, sub, tuple(k < n for n, k in zip(batch.seq_lens, keep)))


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """Place the replayed rows' values [M, ...] at `rows` of a NaN-filled [n, ...] tensor."""
    out = values.new_full((n, *values.shape[1:]), float("nan"))
    out[rows] = values
    return out
