"""Position-derived indices of one static step, built once per step and shared by every layer.

    tables = StepTables(model, shape, plan)            # once per decoder, outside any captured step
    index = StepIndex(starts, T, tables)               # once per step; starts [S] on the device
    cos, sin = index.cos_sin(layer.attn.rope)          # [N, rd/2]: gathered by the first layer of its group
    rows = index.ring_rows(ring)                       # [S, T] rows of the step's positions in the ring

Every layer of a static step sees the same positions, and the ring rows, window key lists, compressor
candidate groups and visibility masks it derives from them depend only on the positions and a few
sizes (ring length, window, compress rate, entry count), which repeat across layers. Built per layer,
they cost about 700 of the 2 430 kernels a v4-mini decode step launched on the H200
(`bench/results/graph-profile-h200.json` → `graph-profile-h200-index.json`); here each is built by
the first layer that asks and reused
by the rest (the same tensors, so the results are unchanged bit for bit). A `StepIndex` lives for one
step (it is created inside the captured call, so a CUDA graph records each build once).

In a CUDA graph every build is still a few launches of tiny kernels (~2 µs each), so what does not
depend on the positions is made once per decoder in `StepTables`: a `RopeTable` per RoPE group (a
step gathers its cos / sin rows in one launch instead of six ops per call) and one long `arange`
span whose slices are every constant range a build needs (views: no launch). Builds use masked
fills and `alpha` adds rather than `torch.where` with Python scalars, which adds a `scalar_tensor`.

Even so a v4-mini step spent ~50 launches here (`bench/results/graph-profile-h200-s9-final-no-pdl.json`,
op_sites). So a decoder also declares its `plan` (`StepPlan`, static_plan.py): the tensors every
step asks for, as `segments` of the registry's `step_index` op (`dspark/kernels/step_index_ref.py`),
which builds all of them, and the step's positions, in one launch into one flat buffer; a `StepIndex` hands out views of it, and the
RoPE rows of every planned table row in one gather from the groups' tables laid end to end. What the
plan leaves out, and everything where the model's `KernelConfig.step_index` is "ref", is built by the
torch code below on first use, as before (the same values).

Shape symbols: S slots of the bucket, T tokens per step, N = S·T, W window, m rate, E entries.
"""

from __future__ import annotations

from typing import Callable

import torch

from dspark.kernels import get_op
from dspark.kernels.step_index_ref import ENTRY_OFFSET, ENTRY_ROW, PHASE, RING, ROW, VISIBLE, SegmentTable
from dspark.models.deepseek_v4.rope import RopeTable
from dspark.models.deepseek_v4.static_plan import (POSITIONS, StepPlan, hca_segment, pool_segment, segment,
                                                   window_segment)
from dspark.models.deepseek_v4.static_state import PositionRing, StaticShape


def rope_groups(model) -> dict[int, int]:
    """{id(layer.attn.rope): group}: layers whose RoPE tables are equal share a group (host-side,
    once per decoder: it compares the tables' values)."""
    tables, groups = [], {}
    for layer in model.layers:
        rope = layer.attn.rope
        for g, other in enumerate(tables):
            if (other.attention_factor == rope.attention_factor and other.inv_freq.shape == rope.inv_freq.shape
                    and torch.equal(other.inv_freq, rope.inv_freq)):
                groups[id(rope)] = g
                break
        else:
            groups[id(rope)] = len(tables)
            tables.append(rope)
    return groups


class StepTables:
    """A decoder's constant index tensors, built once at its construction (they allocate, so never
    inside a captured step): `ropes` a `RopeTable` per RoPE group over positions 0 .. C−1 (`groups`
    maps id(layer.attn.rope) to its group, `rope_groups`; the groups' tables are views of one
    `rope_data` [2, G·C, rd/2] when their rows have one width), the range views `arange`,
    `nonnegative`, `negative` of one span −A .. A − 1, A covering every range a `StepIndex` asks
    for (C, S, T, each layer's window and twice its compress rate), and the `segments` of `plan`
    (a `StepPlan`; None, or the model's `KernelConfig.step_index` at "ref": the positions only) for
    the model's `step_index` op (`step_index_op`): the RoPE rows first (`n_rope` segments, one
    gather), then the positions, then the rest.

    Memory: the tables' C · rd · 4 bytes per group (two groups in V4 / V4.1: 64 MiB at C = 128K),
    plus 34 · A bytes for the spans.
    """

    def __init__(self, model, shape: StaticShape, plan: StepPlan | None = None):
        if not isinstance(shape, StaticShape):
            raise ValueError(f"shape must be a StaticShape, got {shape!r}")
        if plan is not None and not isinstance(plan, StepPlan):
            raise ValueError(f"plan must be a StepPlan or None, got {type(plan).__name__}")
        self.groups = rope_groups(model)
        first = {}  # group -> the first layer's Rope of that group
        for layer in model.layers:
            first.setdefault(self.groups[id(layer.attn.rope)], layer.attn.rope)
        self.ropes = [RopeTable(first[g], shape.max_context) for g in range(len(first))]
        self.context = shape.max_context
        self.rope_data = None  # [2, G·C, rd/2]: every group's rows, so one gather serves all groups
        if len({r.data.shape for r in self.ropes}) == 1:
            self.rope_data = torch.cat([r.data for r in self.ropes], dim=1)
            for g, table in enumerate(self.ropes):
                table.data = self.rope_data[:, g * self.context : (g + 1) * self.context]
        self.reach = _reach(model, shape)
        self.span = torch.arange(-self.reach, self.reach, device=model.device)  # [2A]
        self._below = self.span < 0  # [2A] bool
        self._from_zero = (~self._below).long()  # [2A] long: 0 below 0, 1 from 0 on
        if model.kernels.step_index == "ref":
            # The reference op would build each segment with about as many torch ops as the builds
            # below: at "ref" the step keeps those (the op makes the positions only), as before it.
            plan = None
        self.planned = plan is not None  # every index tensor a step asks for is a view of the op's output
        rope_rows = []
        for rope, rate in (plan.ropes if plan is not None else ()):
            row = self.rope_segment(rope, rate)
            if row is not None and row not in rope_rows:
                rope_rows.append(row)
        rows = rope_rows + [r for r in [POSITIONS] + (plan.segments if plan else []) if r not in rope_rows]
        self.n_rope = len(rope_rows)
        self.segments = SegmentTable.build(list(dict.fromkeys(rows)), model.device)
        self.step_index_op = get_op(model.kernels, "step_index")

    def rope_segment(self, rope, rate: int) -> tuple[int, ...] | None:
        """The `step_index` segment of `rope`'s table rows at the positions (rate 1) or at the first
        positions of the rate-m groups: rows g·C + w·m of `rope_data`; None for a Rope outside the
        model's layers or without `rope_data`."""
        group = self.groups.get(id(rope))
        if group is None or self.rope_data is None:
            return None
        return segment(ROW, m=rate, a=group * self.context)

    def arange(self, start: int, end: int) -> torch.Tensor:
        """[end − start] long start .. end − 1: a view of `span` (no launch)."""
        if not -self.reach <= start <= end <= self.reach:
            raise ValueError(f"arange({start}, {end}) outside the step tables' span [{-self.reach}, {self.reach}]")
        return self.span[self.reach + start : self.reach + end]

    def nonnegative(self, start: int, end: int) -> torch.Tensor:
        """[end − start] long, 1 where start .. end − 1 is >= 0, else 0 (a view: no launch)."""
        self.arange(start, end)  # the range check
        return self._from_zero[self.reach + start : self.reach + end]

    def negative(self, start: int, end: int) -> torch.Tensor:
        """[end − start] bool, start .. end − 1 < 0 (a view: no launch)."""
        self.arange(start, end)
        return self._below[self.reach + start : self.reach + end]


def _reach(model, shape: StaticShape) -> int:
    """The widest range a step's index builds take: slots, tokens, entries (<= C), window key
    offsets (W) and, with overlap, a group's 2m pooled positions."""
    sizes = [shape.max_context, shape.slots, shape.tokens]
    for layer in model.layers:
        attn = layer.attn
        rate = max(getattr(attn, "rate", 0), getattr(attn, "ratio", 0))  # V4 names it rate, V4.1 ratio
        sizes += [attn.window, 2 * rate]
    return max(sizes)


class StepIndex:
    """The memo of one step's position-derived tensors (see the module docstring); `tables` are the
    decoder's `StepTables`. Slot s of the step feeds positions starts[s] + 0 .. tokens − 1, which
    must lie in [0, C) (the tables' RoPE rows). Construction runs `step_index` once (the planned
    segments and `positions` [S, T])."""

    def __init__(self, starts: torch.Tensor, tokens: int, tables: StepTables):
        self.tables = tables
        segments, n_slots = tables.segments, starts.shape[0]
        self._out = tables.step_index_op(starts, segments, tokens=tokens)  # [L] long, every segment
        counts = segments.counts(n_slots, tokens)
        self._planned = {}  # segment row -> its [S, c, width] view of `_out`
        self._rope_offsets = []  # (offset, count) of the RoPE segments in `_out` (its head)
        offset = 0
        for i, (row, count) in enumerate(zip(segments.rows, counts)):
            self._planned[row] = self._out[offset : offset + count].view(n_slots, -1, row[2])
            if i < tables.n_rope:
                self._rope_offsets.append((offset, count))
            offset += count
        self.positions = self._planned[POSITIONS].view(n_slots, tokens)  # [S, T] long
        self.flat = self.positions.reshape(-1)  # [N]
        self._memo: dict[tuple, object] = {}

    def _get(self, key: tuple, build: Callable[[], object]):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def _segment(self, row: tuple[int, ...], shape: tuple[int, ...], build: Callable[[], torch.Tensor]):
        """The tensor of segment `row`: its view of the op's output when planned, else `build()`."""
        def make():
            view = self._planned.get(row)
            return build() if view is None else view.view(shape)
        return self._get(row, make)

    def _rope_rows(self, rope, rate: int, positions: Callable[[], torch.Tensor]):
        """`rope.cos_sin(positions())` (rate 1: the positions; m: the group starts): the planned rows
        of every RoPE segment in one gather, else its group's table rows (one gather), or for a Rope
        outside the model's layers a direct call."""
        row = self.tables.rope_segment(rope, rate)
        segments = self.tables.segments.rows[: self.tables.n_rope]
        if row in segments:
            gathered = self._get(("rope rows",), self._gather_rope_rows)
            return self._get(("rope",) + row, lambda: gathered[segments.index(row)])
        group = self.tables.groups.get(id(rope))
        if group is None:
            return self._get(("module", id(rope), rate), lambda: rope.cos_sin(positions()))
        return self._get(("rope", group, rate), lambda: self.tables.ropes[group].cos_sin(positions()))

    def _gather_rope_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [count, rd/2] of each planned RoPE segment, from one `index_select`."""
        total = sum(count for _, count in self._rope_offsets)
        rows = self.tables.rope_data.index_select(1, self._out[:total])  # [2, total, rd/2]
        return [(rows[0, o : o + n], rows[1, o : o + n]) for o, n in self._rope_offsets]

    def cos_sin(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.cos_sin` of every row's position: ([N, rd/2], [N, rd/2]) fp32."""
        return self._rope_rows(rope, 1, lambda: self.flat)

    def phase(self, rate: int) -> torch.Tensor:
        """[N] position % rate of every row (a compressor's `ape` row)."""
        return self._segment(segment(PHASE, a=rate), (-1,), lambda: self.flat % rate)

    def group_starts(self, rate: int) -> torch.Tensor:
        """[S·c] first position w·m of each candidate group (`groups`): the position its entry stands for."""
        return self._segment(segment(ROW, m=rate), (-1,), lambda: (self.groups(rate) * rate).reshape(-1))

    def group_cos_sin(self, rope, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.cos_sin` of the candidate groups' first positions (`group_starts`): [S·c, rd/2] each."""
        return self._rope_rows(rope, rate, lambda: self.group_starts(rate))

    def ring_rows(self, ring: PositionRing) -> torch.Tensor:
        """[S, T] flat rows of the step's positions in a ring of `ring.size` rows per slot."""
        return self._segment(segment(RING, a=ring.size), self.positions.shape, lambda: ring.rows(self.positions))

    def window_keys(self, window: int, ring: PositionRing) -> torch.Tensor:
        """[N, W] ring rows of keys p − W + 1 .. p of every row, −1 before position 0."""
        def build():
            keys = self.positions.unsqueeze(-1) + self.tables.arange(1 - window, 1)  # [S, T, W]
            return ring.rows(keys).masked_fill_(keys < 0, -1).flatten(0, 1)
        return self._segment(window_segment(window, ring.size), (-1, window), build)

    def csa_keys(self, window: int, ring: PositionRing, width: int) -> torch.Tensor:
        """[N, W + width] the CSA key list of the step: `window_keys`, then `width` columns that each
        CSA layer's top-k selection overwrites with its picks (`select_topk(..., out=)`; −1 until
        then where the op built it). One buffer for all CSA layers of the step: a layer's attention
        reads its picks before the next layer's selection writes them (stream order)."""
        def build():
            keys = torch.empty(self.positions.numel(), window + width, dtype=torch.long, device=self.positions.device)
            keys[:, :window] = self.window_keys(window, ring)
            return keys
        return self._segment(window_segment(window, ring.size, width), (-1, window + width), build)

    def groups(self, rate: int) -> torch.Tensor:
        """[S, c] the compressor groups w a step can complete, c = ceil(T/m), from start // m on
        (group w is complete once its last position (w+1)·m − 1 was fed: `entry_rows`)."""
        def build():
            p = self.positions
            return p[:, :1] // rate + self.tables.arange(0, -(-p.shape[1] // rate))
        return self._get(("groups", rate), build)

    def _group_positions(self, rate: int, overlap: bool) -> torch.Tensor:
        """[S, c, slots] the positions pooled into each candidate group: w·m + (−m .. m − 1) with
        overlap (group w − 1's then w's), w·m + (0 .. m − 1) without; negative = missing."""
        def build():
            n_slots = self.positions.shape[0]
            offsets = self.tables.arange(-rate if overlap else 0, rate)  # [slots]
            return self.group_starts(rate).view(n_slots, -1, 1) + offsets
        return self._get(("group_pos", rate, overlap), build)

    def group_rows(self, rate: int, overlap: bool, ring: PositionRing):
        """The ring rows pooled into each candidate group: (rows [S, c, slots], half [slots] long,
        missing [S, c, slots, 1] bool). Without overlap the m rows of group w; with overlap the "a"
        halves (half 0) of group w − 1 then the "b" halves (half 1) of group w; group −1 is missing
        (its rows are some row of the slot, to be masked). Without overlap, `pool_index`'s planned
        segment is the rows."""
        def build():
            if overlap:
                pos = self._group_positions(rate, overlap)  # [S, c, slots]
                half, missing = self.tables.nonnegative(-rate, rate), pos < 0
                return ring.rows(pos), half, missing.unsqueeze(-1)
            # every position is >= 0: half and missing are constant views, no launch
            rows = self.pool_index(rate, False, ring).view(self.positions.shape[0], -1, rate)
            half, missing = self.tables.nonnegative(-rate, 0), self.tables.negative(0, rate).expand_as(rows)
            return rows, half, missing.unsqueeze(-1)
        return self._get(("group_rows", rate, overlap, ring.size), build)

    def pool_index(self, rate: int, overlap: bool, ring: PositionRing) -> torch.Tensor:
        """`group_rows` as one index into the ring viewed as d_c-wide half-rows (row·coff + half),
        −1 for a missing slot: [S·c, slots], what `compressor_pool_gather` reads."""
        def build():
            if not overlap:  # coff 1, half 0 and nothing missing: the rows themselves
                return ring.rows(self._group_positions(rate, False)).flatten(0, 1)
            rows, half, missing = self.group_rows(rate, overlap, ring)
            return torch.add(half, rows, alpha=2).masked_fill_(missing.squeeze(-1), -1).flatten(0, 1)
        return self._segment(pool_segment(rate, overlap, ring.size), (-1, 2 * rate if overlap else rate), build)

    def entry_rows(self, rate: int, n_entries: int) -> torch.Tensor:
        """[S·c] flat entry rows (slot·(E+1) + w) of the candidate groups; a group not complete yet
        (w >= (p_last + 1) // m, `visible` of the step's last position) goes to the trash row E of
        its slot."""
        def build():
            w = self.groups(rate)  # [S, c]
            incomplete = w >= self.visible(rate)[:, -1:]
            slots = self.tables.arange(0, w.shape[0]).unsqueeze(-1)  # [S, 1]
            return torch.add(w.masked_fill(incomplete, n_entries), slots, alpha=n_entries + 1).reshape(-1)
        return self._segment(segment(ENTRY_ROW, m=rate, a=n_entries), (-1,), build)

    def entry_offsets(self, first: int, n_entries: int) -> torch.Tensor:
        """[N, 1] pool row of entry 0 of each row's slot, slot s's entries starting at first + s·(E+1)."""
        def build():
            slots = self.tables.arange(0, self.positions.shape[0]).unsqueeze(-1).expand_as(self.positions)
            return (slots * (n_entries + 1)).add_(first).reshape(-1, 1)  # mul writes a fresh [S, T]
        return self._segment(segment(ENTRY_OFFSET, a=first, b=n_entries), (-1, 1), build)

    def visible(self, rate: int) -> torch.Tensor:
        """[S, T] entries complete for each row: (p + 1) // m (entry w is reachable when w < it)."""
        return self._segment(segment(VISIBLE, a=rate), self.positions.shape, lambda: (self.positions + 1) // rate)

    def unreachable(self, rate: int, n_entries: int) -> torch.Tensor:
        """[N, E] bool: entry w is not complete yet for row p, w >= (p + 1) // m."""
        def build():
            return self.tables.arange(0, n_entries) >= self.visible(rate).reshape(-1, 1)
        return self._get(("unreachable", rate, n_entries), build)

    def hca_keys(self, window: int, ring: PositionRing, rate: int, n_entries: int, first: int) -> torch.Tensor:
        """[N, W + E] the HCA key list [`window_keys` | `causal_entries`]: position-derived only, so
        the HCA layers of a step share one (their rings and entry pools have the same sizes)."""
        return self._segment(hca_segment(window, ring.size, rate, n_entries, first), (-1, window + n_entries),
                             lambda: torch.cat((self.window_keys(window, ring),
                                                self.causal_entries(rate, n_entries, first)), dim=-1))

    def causal_entries(self, rate: int, n_entries: int, first: int) -> torch.Tensor:
        """[N, E] pool rows of every entry a row can see (HCA), −1 for the rest."""
        def build():
            entries = self.tables.arange(0, n_entries) + self.entry_offsets(first, n_entries)  # [N, E]
            return entries.masked_fill_(self.unreachable(rate, n_entries), -1)
        return self._get(("causal", rate, n_entries, first), build)
