"""What every static step of a decoder asks its `StepIndex` for: a `StepPlan`, recorded once at the
decoder's construction by calling the same methods with the same arguments, as `step_index` segment
rows (dspark/kernels/step_index_ref.py). `StepTables` (static_index.py) lays them out; a step's
`StepIndex` gets them all from one launch. A segment row is also the memo key of its tensor, so the
helpers here are the one place that turns a request into its row.

Shape symbols: as static_index.py.
"""

from __future__ import annotations

from dspark.kernels.step_index_ref import ENTRY_OFFSET, ENTRY_ROW, KEYS, PHASE, POOL, RING, ROW, VISIBLE
from dspark.models.deepseek_v4.static_state import PositionRing


def segment(kind: int, m: int = 1, width: int = 1, a: int = 0, b: int = 0, c: int = 0, d: int = 0,
             e: int = 0) -> tuple[int, ...]:
    """One `step_index` segment row (see dspark/kernels/step_index_ref.py): also the memo key of its tensor."""
    return (kind, m, width, a, b, c, d, e)


POSITIONS = segment(ROW)  # [S, T] the step's positions


def window_segment(window: int, size: int, extra: int = 0) -> tuple[int, ...]:
    """[N, W + extra]: window keys of a ring of `size` rows per slot, then `extra` columns of −1."""
    return segment(KEYS, width=window + extra, a=size, b=window, c=1)


def hca_segment(window: int, size: int, rate: int, n_entries: int, first: int) -> tuple[int, ...]:
    """[N, W + E]: window keys, then the causal entries (pool rows first + s·(E+1) + w, −1 unreachable)."""
    return segment(KEYS, width=window + n_entries, a=size, b=window, c=rate, d=n_entries, e=first)


def pool_segment(rate: int, overlap: bool, size: int) -> tuple[int, ...]:
    """[S·c, slots]: `StepIndex.pool_index`."""
    return segment(POOL, m=rate, width=2 * rate if overlap else rate, a=size, b=int(overlap))


class StepPlan:
    """What every step of a decoder asks its `StepIndex` for, recorded by calling the same methods
    (same arguments) once at the decoder's construction: `StepTables` turns it into the segments
    that the `step_index` op builds in one launch per step. Methods return nothing."""

    def __init__(self):
        self.segments: list[tuple[int, ...]] = []
        self.ropes: list[tuple[object, int]] = []  # (rope module, rate): RoPE rows of positions (1) or groups

    def _add(self, row: tuple[int, ...]) -> None:
        if row not in self.segments:
            self.segments.append(row)

    def cos_sin(self, rope) -> None:
        self.ropes.append((rope, 1))

    def group_cos_sin(self, rope, rate: int) -> None:
        self.ropes.append((rope, rate))

    def ring_rows(self, ring: PositionRing) -> None:
        self._add(segment(RING, a=ring.size))

    def window_keys(self, window: int, ring: PositionRing) -> None:
        self._add(window_segment(window, ring.size))

    def csa_keys(self, window: int, ring: PositionRing, width: int) -> None:
        self._add(window_segment(window, ring.size, width))

    def hca_keys(self, window: int, ring: PositionRing, rate: int, n_entries: int, first: int) -> None:
        self._add(hca_segment(window, ring.size, rate, n_entries, first))

    def phase(self, rate: int) -> None:
        self._add(segment(PHASE, a=rate))

    def group_starts(self, rate: int) -> None:
        self._add(segment(ROW, m=rate))

    def pool_index(self, rate: int, overlap: bool, ring: PositionRing) -> None:
        self._add(pool_segment(rate, overlap, ring.size))

    def entry_rows(self, rate: int, n_entries: int) -> None:
        self._add(segment(ENTRY_ROW, m=rate, a=n_entries))

    def entry_offsets(self, first: int, n_entries: int) -> None:
        self._add(segment(ENTRY_OFFSET, a=first, b=n_entries))

    def visible(self, rate: int) -> None:
        self._add(segment(VISIBLE, a=rate))
