"""Fixed-capacity DSpark draft state for S slots: static shapes, positions decide visibility.

`DSparkState` (context.py) grows per request and keeps its length on the host, so drafting from it
cannot be captured in a CUDA graph. Here the context keys of every stage live in one ring per stage,
allocated once for a bucket of S slots and at most T committed rows per `observe`:

    per stage     ring [S, R, d],  R = W + T        row of position p of slot s: s·R + p mod R

`observe` writes all T rows it is given, at positions start .. start + T − 1, with `index_copy_` at
rows computed on the device; a block anchored at position a reads positions a − W .. a − 1 (those
< 0 are −1, absent), exactly the rows `gather_context` gives the dynamic path. Nothing records which
rows are committed: the caller passes the next anchor position, and rows at positions >= it (drafts
that were rejected, padding) are never read and are overwritten when those positions are observed
again. The rollback rule is the target's static state's: the next `observe` may start anywhere from
the previous start to the previous start + T. R = W + T keeps the W rows before the next anchor
intact through any such write: a row written at position q >= a lands on the row of q − R, and
q − R < a − W because q <= start + T − 1 <= a + T − 1.

Shape symbols: S slots, T rows per observe (at most), W window, R = W + T ring rows, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.draft.context import DSparkState
from dspark.models.deepseek_v4.static_state import PositionRing, check_slot, move_slot


@dataclass(frozen=True)
class StaticDraftShape:
    """The bucket: `slots` S, `tokens` T committed rows per `observe` at most (γ + 1 for a verify round)."""

    slots: int
    tokens: int

    def __post_init__(self) -> None:
        for name in ("slots", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticDraftShape.{name}={value!r}: must be a positive int")


class StaticDraftState:
    """Per stage a `PositionRing` [S, W + T, d] of context keys (model dtype, on the drafter's device).

    Zero-filled: an absent key (−1) reads pool row 0 with weight 0, so no row may hold a NaN.
    """

    def __init__(self, num_stages: int, window: int, head_dim: int, shape: StaticDraftShape, dtype, device):
        if not isinstance(shape, StaticDraftShape):
            raise ValueError(f"shape must be a StaticDraftShape, got {shape!r}")
        self.shape = shape
        self.window = window
        size = window + shape.tokens
        self.rings = [PositionRing(torch.zeros(shape.slots, size, head_dim, dtype=dtype, device=device))
                      for _ in range(num_stages)]

    def pools(self) -> list[torch.Tensor]:
        """Per stage the [S·R, d] key pool (views: no copy)."""
        return [ring.flat() for ring in self.rings]

    def write(self, positions: torch.Tensor, latents: list[torch.Tensor]) -> None:
        """Store the keys latents[s] [b·T, d] of positions [b, T] of slots 0 .. b − 1 (T <= shape.tokens)."""
        for ring, keys in zip(self.rings, latents):
            ring.write(positions, keys)

    def context_index(self, anchor_positions: torch.Tensor) -> torch.Tensor:
        """[b, W] pool rows of positions a − W .. a − 1 of the anchors a [b] of slots 0 .. b − 1; −1
        before position 0."""
        ring = self.rings[0]
        keys = anchor_positions[:, None] - self.window + torch.arange(self.window, device=anchor_positions.device)
        return torch.where(keys >= 0, ring.rows(keys), -1)

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: copy src's ring rows of every stage."""
        move_slot([ring.data for ring in self.rings], self.shape.slots, src, dst)

    def load(self, slot: int, dstate: DSparkState) -> int:
        """Copy a request's dynamic draft state into `slot`; returns its length (the position of its
        next anchor). Host-side (reads the state's counters), never captured."""
        check_slot(slot, self.shape.slots)
        if not isinstance(dstate, DSparkState) or len(dstate.latents) != len(self.rings):
            raise ValueError(f"dstate must be a DSparkState with {len(self.rings)} stages, got {type(dstate).__name__}")
        if dstate.window != self.window:
            raise ValueError(f"dstate window {dstate.window} differs from the static state's {self.window}")
        # The static index treats every position >= 0 of the last W as present, so the dynamic state
        # must hold all of them (it does whenever it was built by `observe`).
        if dstate.rows != min(dstate.length, self.window):
            raise ValueError(f"dstate holds {dstate.rows} rows at length {dstate.length}; "
                             f"expected min(length, W={self.window})")
        for ring, keys in zip(self.rings, dstate.latents):
            if keys is not None:
                ring.load(slot, dstate.start, keys)
        return dstate.length
