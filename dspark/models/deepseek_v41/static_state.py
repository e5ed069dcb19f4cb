"""Fixed-capacity decode state of DeepSeek-V4.1 for S slots: static shapes, positions decide visibility.

The V4.1 analogue of `deepseek_v4/static_state.py` (same bucket `StaticShape`, same `PositionRing`):
every buffer is allocated once for S slots, a context capacity C and at most T tokens per step, and
a step addresses it only through rows computed on the device from positions (`static_step.py`).

    part                                buffer                                  row of position p / entry w
    window latents, every layer         ring [S, Rw, d],  Rw = W − 1 + T         slot·Rw + p mod Rw
    source rows (kv, gate; ratio m > 1) ring [S, Rr, d] fp32, Rr = m − 1 + T     slot·Rr + p mod Rr
    source entries                      [S, E + 1, d],    E = C // m             slot·(E+1) + w  (row E: trash)
    source index keys                   [S, E + 1, di]                            the same
    Engram n-gram ids (compressed)      ring [S, Rn] long, Rn = N − 1 + T        slot·Rn + p mod Rn

All window rings and all entries live in ONE pool tensor of the model, the `sparse_attention` op's
pool of every layer (a layer's key list points into its own window ring and its KV source's entries,
which other layers share, spec §5.5):

    pool = [ window rings of layers 0..L−1 | entries of KV sources s_0, s_1, ... ]     [P, d]

Every buffer is slot-major and every row a step touches is computed from its slot number, so a step
over a bucket of the first b <= S slots touches those slots' rows only (the pool is addressed, never
sliced); `move(src, dst)` copies one slot's rows of every buffer to another slot.

Nothing records which rows are live: a query at p sees window keys p−W+1 .. p and entries
w < (p+1)//m, and an n-gram looks back at p−1 .. p−N+1, so rows written for positions a slot no
longer holds are invisible and are overwritten when those positions are fed again. Rollback is
feeding the next step from an earlier start, no earlier than the previous step's start (the rings
keep one step beyond what the next query reads; `DecodeState.rewind_floor` is the same rule). The
capacities hold what a step reads before its start (W − 1 keys, the m − 1 rows of an incomplete
group, N − 1 ids) plus its T new rows, all at distinct ring rows.

Shape symbols: S slots, C context capacity, T tokens per step (at most), W window, m a source's
compression ratio, E = C // m entries, d head dim, di index head dim, N max n-gram size, L layers.
"""

from __future__ import annotations

import torch

from dspark.models.deepseek_v4.static_state import PositionRing, StaticShape, check_slot, move_slot
from dspark.models.deepseek_v41.state import DecodeStateV41, NgramHistory, SourceCache


class StaticSource:
    """One KV-source layer's shared state: `kv`, `gate` rings [S, Rr, d] fp32 (ratio > 1 only, else
    None), `entries` [S, E + 1, d] (a view of the pool from row `offset`), `keys` [S, E + 1, di]."""

    def __init__(self, shape: StaticShape, rate: int, entries: torch.Tensor, offset: int, index_dim: int):
        s, device = shape.slots, entries.device
        self.rate = rate
        self.dim = entries.shape[-1]
        self.n_entries = entries.shape[1] - 1  # E; row E is the trash row of entries not complete yet
        self.entries = entries
        self.offset = offset  # pool row of slot 0's entry 0
        self.keys = torch.zeros(s, self.n_entries + 1, index_dim, dtype=entries.dtype, device=device)
        self.kv = self.gate = None
        if rate > 1:
            ring = (s, rate - 1 + shape.tokens, self.dim)
            self.kv = PositionRing(torch.zeros(ring, dtype=torch.float32, device=device))
            self.gate = PositionRing(torch.zeros(ring, dtype=torch.float32, device=device))

    def write_entries(self, rows: torch.Tensor, entries: torch.Tensor, keys: torch.Tensor) -> None:
        """Entries / index keys [b·c, d] / [b·c, di] of the step's candidate groups at their flat
        rows [b·c] (`StepIndex.entry_rows`: slot·(E+1) + w, or the slot's trash row E while the group
        is incomplete; the same number of writes every step)."""
        self.entries.view(-1, self.dim).index_copy_(0, rows, entries.to(self.entries.dtype))
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, rows, keys.to(self.keys.dtype))

    def load(self, slot: int, cache: SourceCache, length: int) -> None:
        """Copy what future steps read from a dynamic source at `length` tokens: the incomplete
        group's rows and every entry and index key."""
        if cache.rate != self.rate:
            raise ValueError(f"source cache ratio {cache.rate} does not match the static state's {self.rate}")
        n = length // self.rate
        if cache.n_entries != n:
            raise ValueError(f"source cache holds {cache.n_entries} entries; length {length} needs {n}")
        if self.kv is not None:
            first = cache.live_from(length)
            if first < cache.rows_start or cache.rows_end != length:
                raise ValueError(f"source cache holds rows {cache.rows_start}..{cache.rows_end}; "
                                 f"length {length} needs rows {first}..{length}")
            kv, gate = cache.rows()
            self.kv.load(slot, first, kv[first - cache.rows_start :])
            self.gate.load(slot, first, gate[first - cache.rows_start :])
        self.entries[slot, :n] = cache.entries()
        self.keys[slot, :n] = cache.index_keys()


class StaticStateV41:
    """The static decode state of a `DeepseekV41ForCausalLM` for one bucket (`StaticShape`).

    pool [P, d] (see the module docstring), `windows` one `PositionRing` per layer (views of the
    pool), `window_offsets` their first pool rows, `sources` {KV-source layer: `StaticSource`},
    `ngram` a `PositionRing` [S, Rn] of compressed ids (None without Engram layers).
    """

    def __init__(self, model, shape: StaticShape):
        c, s = model.config, shape.slots
        self.shape = shape
        window_rows = s * (c.sliding_window - 1 + shape.tokens)
        n_entries = {i: shape.max_context // c.compress_ratios[i] for i in c.kv_source_layer_ids}
        size = len(model.layers) * window_rows + sum(s * (e + 1) for e in n_entries.values())
        self.pool = torch.zeros(size, c.head_dim, dtype=model.dtype, device=model.device)
        self.window_offsets = [i * window_rows for i in range(len(model.layers))]
        self.windows = [PositionRing(self.pool[o : o + window_rows].view(s, -1, c.head_dim))
                        for o in self.window_offsets]
        self.sources: dict[int, StaticSource] = {}
        offset = len(model.layers) * window_rows
        for i, e in n_entries.items():
            entries = self.pool[offset : offset + s * (e + 1)].view(s, e + 1, c.head_dim)
            self.sources[i] = StaticSource(shape, c.compress_ratios[i], entries, offset, c.index_head_dim)
            offset += s * (e + 1)
        self.ngram = None
        if model.engram_ids:
            ring = (s, c.engram_max_ngram_size - 1 + shape.tokens)
            self.ngram = PositionRing(torch.zeros(ring, dtype=torch.long, device=model.device))

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every per-slot buffer, slot-major [S, ...] (views of the pool where they live there)."""
        out = [ring.data for ring in self.windows]
        for source in self.sources.values():
            out += [source.entries, source.keys]
            if source.kv is not None:
                out += [source.kv.data, source.gate.data]
        if self.ngram is not None:
            out.append(self.ngram.data)
        return out

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: copy src's rows of every buffer (see `move_slot`)."""
        move_slot(self.slot_tensors(), self.shape.slots, src, dst)

    def load(self, slot: int, state: DecodeStateV41) -> int:
        """Copy a request's dynamic state (right after its prefill, or any later call) into `slot`;
        returns its length, the start position of the slot's next step. Host-side (reads Python
        counters), not captured."""
        check_slot(slot, self.shape.slots)
        if not isinstance(state, DecodeStateV41) or len(state.layers) != len(self.windows) \
                or set(state.sources) != set(self.sources) or (state.ngram is None) != (self.ngram is None):
            raise ValueError(f"state must be a DecodeStateV41 of this model ({len(self.windows)} layers, KV sources "
                             f"{sorted(self.sources)}), got {type(state).__name__}")
        length = state.length
        if length + self.shape.tokens > self.shape.max_context:
            raise ValueError(f"state length {length} + tokens per step {self.shape.tokens} exceeds "
                             f"max_context={self.shape.max_context}")
        for ring, cache in zip(self.windows, state.layers):
            window = cache.window
            first = window.live_from(length)
            if first < window.start or window.end != length:
                raise ValueError(f"window cache holds positions {window.start}..{window.end}; "
                                 f"length {length} needs {first}..{length}")
            ring.load(slot, first, window.latents()[first - window.start :])
        for i, source in self.sources.items():
            source.load(slot, state.sources[i], length)
        if self.ngram is not None:
            self._load_ngram(slot, state.ngram, length)
        return length

    def _load_ngram(self, slot: int, history: NgramHistory, length: int) -> None:
        first = history.live_from(length)
        if first < history.start or history.end != length:
            raise ValueError(f"n-gram history holds positions {history.start}..{history.end}; "
                             f"length {length} needs {first}..{length}")
        ids = history.snapshot(length, live_only=True)["ids"]  # positions first .. length − 1
        self.ngram.load(slot, first, ids)
