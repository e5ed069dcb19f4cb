"""Every position-derived index tensor of a static decode step in one launch (`StepIndex`): the
segment layout and the torch reference (the Triton kernel is in step_index.py; this module imports
no Triton, so the models import the layout freely).

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``step_index(starts, segments, *, tokens) -> out``: starts [b] long (slot s feeds positions
  p = starts[s] + 0 .. tokens − 1), `segments` a `SegmentTable` -> out [segments.size(b, tokens)]
  long, the segments' tensors one after another (flat; `SegmentTable.offsets` says where each
  starts, the caller takes views).

A segment is (kind, m, width, a, b, c, d, e): it has b · ceil(T/m) · width elements, element
(s, i, j) at s·ceil(T/m)·width + i·width + j, with w = starts[s] // m + i (the i-th compressor group
of rate m the step can complete; m = 1: w is the token's position p). Kinds (what `StepIndex`
builds, with the formulas of its docstrings):

    ROW          base a + w·m                          positions (a 0, m 1), group starts, RoPE table rows
    RING         s·R + p mod R              a R        rows of the positions in a ring of R rows per slot
    KEYS         j < W:    s·R + k mod R, k = p − W + 1 + j, −1 for k < 0       window keys
                 W <= j < W + E: first + s·(E+1) + (j − W), −1 for j − W >= (p+1) // rate   causal entries
                 the rest: −1 (columns a CSA selection overwrites)
                             a R, b W, c rate, d E, e first
    PHASE        p mod a                               a compressor's `ape` row
    POOL         pos = w·m + j − b·m; b = 1 (overlap): 2·(s·R + pos mod R) + (j >= m), −1 for pos < 0;
                 b = 0: s·R + pos mod R                a R, b overlap     `compressor_pool_gather` slots
    ENTRY_ROW    (w >= (starts[s] + T) // m ? a : w) + s·(a+1)              entry rows (a = E)
    ENTRY_OFFSET a + s·(b+1)                            first pool row of the slot's entries
    VISIBLE      (p + 1) // a                           entries complete for each row

Integers are exact, so the kernel equals the reference bit for bit. The reference is a few torch ops
per segment (the former per-tensor builds); the kernel is one launch of (segments, element blocks)
programs whatever the model: the ~50 index launches of a v4-mini decode step
(`bench/results/graph-profile-h200-s9-final-no-pdl.json`, op_sites) become this launch and one RoPE
row gather. No host read: CUDA-graph capturable.

Shape symbols: b slots of the step, T tokens per step, G segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


ROW, RING, KEYS, PHASE, POOL, ENTRY_ROW, ENTRY_OFFSET, VISIBLE = range(8)
FIELDS = 8  # kind, m, width, a, b, c, d, e


@dataclass(frozen=True)
class SegmentTable:
    """The segments of one step layout: `rows` on the host (the reference reads them), `table` the
    same as a device tensor [G, 8] long (the kernel reads it). Build with `SegmentTable.build`."""

    rows: tuple[tuple[int, ...], ...]
    table: torch.Tensor

    @classmethod
    def build(cls, rows, device) -> SegmentTable:
        """rows: (kind, m, width, a, b, c, d, e) per segment, ints, m >= 1, width >= 1 (host-side:
        it copies them to `device`; never inside a captured step)."""
        rows = tuple(tuple(int(v) for v in row) for row in rows)
        for row in rows:
            if len(row) != FIELDS or not 0 <= row[0] <= VISIBLE or row[1] < 1 or row[2] < 1:
                raise ValueError(f"segment {row!r}: must be (kind 0..{VISIBLE}, m >= 1, width >= 1, a, b, c, d, e)")
        table = torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), FIELDS)
        return cls(rows, table)

    def counts(self, n_slots: int, tokens: int) -> list[int]:
        """Elements of each segment for b = n_slots slots and T = tokens."""
        return [n_slots * -(-tokens // m) * width for _, m, width, *_ in self.rows]

    def offsets(self, n_slots: int, tokens: int) -> list[int]:
        """Where each segment starts in `out`."""
        out, total = [], 0
        for count in self.counts(n_slots, tokens):
            out.append(total)
            total += count
        return out

    def size(self, n_slots: int, tokens: int) -> int:
        return sum(self.counts(n_slots, tokens))


def _check_args(starts: torch.Tensor, segments: SegmentTable, tokens: int) -> None:
    if starts.dim() != 1 or starts.dtype != torch.long or starts.numel() == 0:
        raise ValueError(f"starts must be a non-empty long [b] tensor, got {tuple(starts.shape)} {starts.dtype}")
    if not isinstance(segments, SegmentTable):
        raise ValueError(f"segments must be a SegmentTable, got {type(segments).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r}: must be a positive int")


class _Grids:
    """The reference's index grids, each made once per call: slot [b, 1, 1], w [b, c, 1] per rate m,
    j [1, 1, width] per width."""

    def __init__(self, starts: torch.Tensor, tokens: int):
        self.starts, self.tokens = starts, tokens
        self._memo = {}

    def _get(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def slot(self) -> torch.Tensor:
        return self._get("slot", lambda: torch.arange(self.starts.shape[0], device=self.starts.device).view(-1, 1, 1))

    def w(self, m: int) -> torch.Tensor:
        def build():
            first = self.starts if m == 1 else self.starts // m
            return first.view(-1, 1, 1) + torch.arange(-(-self.tokens // m), device=self.starts.device).view(1, -1, 1)
        return self._get(("w", m), build)

    def j(self, width: int) -> torch.Tensor:
        return self._get(("j", width), lambda: torch.arange(width, device=self.starts.device).view(1, 1, -1))


def _segment_ref(grids: _Grids, row: tuple[int, ...]) -> torch.Tensor:
    """One segment's [b, ceil(T/m), width] values (the formulas of the module docstring)."""
    kind, m, width, a, b, c, d, e = row
    w = grids.w(m)
    if kind == ROW:
        out = w if (m, a) == (1, 0) else w * m + a
    elif kind == RING:
        out = grids.slot() * a + w.remainder(a)
    elif kind == KEYS:
        j = grids.j(width)
        k = w - b + 1 + j
        out = torch.where(k >= 0, grids.slot() * a + k.remainder(a), -1)
        if width > b:  # the columns after the window: causal entries (d of them), then −1
            entry = j - b
            causal = torch.where(entry < (w + 1) // c, e + grids.slot() * (d + 1) + entry, -1)
            out = torch.where(j < b, out, torch.where(entry < d, causal, -1))
    elif kind == PHASE:
        out = w.remainder(a)
    elif kind == POOL:
        j = grids.j(width)
        pos = w * m + j - b * m
        rows = grids.slot() * a + pos.remainder(a)
        out = torch.where(pos < 0, -1, 2 * rows + (j >= m).long()) if b else rows
    elif kind == ENTRY_ROW:
        complete = (grids.starts + grids.tokens).view(-1, 1, 1) // m
        out = torch.where(w >= complete, a, w) + grids.slot() * (a + 1)
    elif kind == ENTRY_OFFSET:
        out = (grids.slot() * (b + 1) + a).expand_as(w)
    else:  # VISIBLE
        out = (w + 1) // a
    return out.expand(-1, -1, width)


def step_index_ref(starts: torch.Tensor, segments: SegmentTable, *, tokens: int) -> torch.Tensor:
    """starts [b] long -> [segments.size(b, tokens)] long: every segment's values, flat, in order (torch)."""
    _check_args(starts, segments, tokens)
    grids = _Grids(starts, tokens)
    parts = [_segment_ref(grids, row).reshape(-1) for row in segments.rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
