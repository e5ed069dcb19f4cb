"""Fixed-capacity decode state of DeepSeek-V4 for S slots: static shapes, positions decide visibility.

`DecodeState` (state.py) grows per request and keeps host-side counters, so a step over it cannot be
captured in a CUDA graph. Here every buffer is allocated once for a bucket of S slots, a context
capacity C and at most T tokens per step, and a step addresses it only through positions computed on
the device (`static_step.py`):

    per layer                  buffer                                   row of position p / entry w
    window latents (K = V)     ring [S, Rw, d],  Rw = W − 1 + T          slot·Rw + p mod Rw
    compressor rows (C, Z+ape) ring [S, Rr, coff·d_c], Rr = coff·m − 1 + T slot·Rr + p mod Rr
    compressed entries         [S, E + 1, d],    E = C // m              slot·(E+1) + w  (row E: trash)
    indexer rows / keys (CSA)  the same, with the indexer's width d_i

The window ring and the entries are two views of ONE pool tensor per layer,

    pool = [ window ring of slots 0..S−1  |  entries of slots 0..S−1 ]        [S·Rw + S·(E+1), d]

so the attention reads it as the `sparse_attention` op's pool without concatenating anything.
Every buffer is slot-major, and every row a step touches is computed from its slot number, so a step
over a bucket of the first b <= S slots (inputs [b, T]) reads and writes those slots' rows only; the
pool stays whole (its rows are addressed, never sliced). `move(src, dst)` copies one slot's rows of
every buffer to another slot (the engine keeps its live slots compact, 0 .. n − 1).

Nothing records which rows are live: a query at position p sees window keys p−W+1 .. p and entries
w < (p+1)//m, so rows written for positions a slot no longer holds are invisible and are overwritten
when those positions are fed again. Rollback is therefore just feeding the next step from an earlier
start position, as long as that start is not before the start of the previous step (the rings keep
exactly one step of history beyond what the next query needs; `DecodeState.rewind_floor` is the same
rule). Capacities: Rw = W − 1 + T holds the W − 1 keys before a step plus its T new ones; Rr holds the
rows the entries that a step can complete pool (from (w0 − 1)·m, w0 = start // m, with overlap).

Shape symbols: S slots, C context capacity, T tokens per step (at most), W window, m compress rate,
E = C // m entries, d head dim, d_c entry width, coff = 2 with overlap (CSA), 1 without (HCA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.deepseek_v4.state import CompressorCache, DecodeState


@dataclass(frozen=True)
class StaticShape:
    """The bucket: `slots` S, `max_context` C (positions 0 .. C−1), `tokens` T per step at most."""

    slots: int
    max_context: int
    tokens: int

    def __post_init__(self) -> None:
        for name in ("slots", "max_context", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticShape.{name}={value!r}: must be a positive int")
        if self.tokens > self.max_context:
            raise ValueError(f"StaticShape.tokens={self.tokens} exceeds max_context={self.max_context}")


class PositionRing:
    """Per-token rows of S slots in a ring over absolute positions: data [S, R, *tail]."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.slots, self.size = data.shape[:2]
        # [S] first flat row slot·R of each slot: made here, outside any captured step, so `rows`
        # costs two launches (remainder, add) instead of four.
        self.base = torch.arange(self.slots, device=data.device) * self.size

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat row (slot·R + p mod R) of positions [b, ...] of slots 0 .. b − 1 (b <= S) -> same
        shape, long. The data is slot-major, so a bucket of the first b slots is a prefix. A negative
        p also lands on a row of its slot (p mod R >= 0), which callers mask."""
        base = self.base[: positions.shape[0]].view(-1, *([1] * (positions.dim() - 1)))
        return positions.remainder(self.size) + base

    def flat(self) -> torch.Tensor:
        """[S·R, *tail] view of the data."""
        return self.data.flatten(0, 1)

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """values [b·T, *tail] for positions [b, T] of slots 0 .. b − 1 (distinct per slot, T <= R)."""
        self.write_rows(self.rows(positions), values)

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """`write` at rows already computed by `rows(positions)` (a step shares them across layers)."""
        self.flat().index_copy_(0, rows.reshape(-1), values.to(self.data.dtype))

    def load(self, slot: int, first: int, values: torch.Tensor) -> None:
        """Host-side: the rows of positions first .. first + n − 1 of one slot, values [n, *tail]."""
        rows = torch.arange(first, first + values.shape[0], device=self.data.device).remainder(self.size)
        self.data[slot].index_copy_(0, rows, values.to(self.data.dtype))


class StaticCompressorState:
    """One compressor's static state (see the module docstring): `kv` ring [S, Rr, coff·d_c] (model
    dtype), `score` ring [S, Rr, coff·d_c] fp32, `entries` [S, E + 1, d_c] (row E: trash)."""

    def __init__(self, shape: StaticShape, rate: int, overlap: bool, dim: int, entries: torch.Tensor, dtype,
                 device):
        self.rate = rate
        self.overlap = overlap
        self.dim = dim
        coff = 2 if overlap else 1
        ring = (shape.slots, coff * rate - 1 + shape.tokens, coff * dim)
        self.kv = PositionRing(torch.zeros(ring, dtype=dtype, device=device))
        self.score = PositionRing(torch.zeros(ring, dtype=torch.float32, device=device))
        self.entries = entries
        self.n_entries = entries.shape[1] - 1  # E; row E is the trash row of entries not yet complete

    def load(self, slot: int, cache: CompressorCache, length: int) -> None:
        """Copy what future steps read from a dynamic cache at `length` tokens: the live rows and
        every entry."""
        if (cache.rate, cache.overlap, cache.head_dim) != (self.rate, self.overlap, self.dim):
            raise ValueError(f"compressor cache (rate {cache.rate}, overlap {cache.overlap}, dim {cache.head_dim}) "
                             f"does not match the static state's ({self.rate}, {self.overlap}, {self.dim})")
        first = cache.live_from(length)
        if first < cache.rows_start or cache.rows_end != length or cache.n_entries != length // self.rate:
            raise ValueError(f"compressor cache holds rows {cache.rows_start}..{cache.rows_end} and "
                             f"{cache.n_entries} entries; length {length} needs rows {first}.. and "
                             f"{length // self.rate} entries")
        kv, score = cache.rows()
        self.kv.load(slot, first, kv[first - cache.rows_start :])
        self.score.load(slot, first, score[first - cache.rows_start :])
        n = cache.n_entries
        self.entries[slot, :n] = cache.entries()


@dataclass
class StaticLayerState:
    """One attention layer: `pool` [S·Rw + S·(E+1), d], `window` (a ring view of its head),
    `compressor` (CSA, HCA; its entries are the pool's tail) and `indexer` (CSA)."""

    pool: torch.Tensor
    window: PositionRing
    compressor: StaticCompressorState | None = None
    indexer: StaticCompressorState | None = None



def new_layer_state(attn, shape: StaticShape, dtype, device) -> StaticLayerState:
    """Zeroed static state of one `Attention` module (zeros: a −1 key reads pool row 0, times weight 0,
    so no buffer may ever hold a NaN)."""
    s, d = shape.slots, attn.head_dim
    window_rows = s * (attn.window - 1 + shape.tokens)
    n_entries = shape.max_context // attn.rate if attn.compressor is not None else -1
    pool = torch.zeros(window_rows + s * (n_entries + 1), d, dtype=dtype, device=device)
    layer = StaticLayerState(pool, PositionRing(pool[:window_rows].view(s, -1, d)))
    if attn.compressor is not None:
        entries = pool[window_rows:].view(s, n_entries + 1, d)
        layer.compressor = StaticCompressorState(shape, attn.rate, attn.compressor.overlap, d, entries, dtype, device)
    if attn.indexer is not None:
        di = attn.indexer.head_dim
        keys = torch.zeros(s, n_entries + 1, di, dtype=dtype, device=device)
        layer.indexer = StaticCompressorState(shape, attn.rate, True, di, keys, dtype, device)
    return layer


def check_slot(slot, slots: int, name: str = "slot") -> None:
    """ValueError unless `slot` is an int in [0, slots)."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < slots:
        raise ValueError(f"{name}={slot!r} outside [0, {slots})")


def move_slot(tensors, slots: int, src: int, dst: int) -> None:
    """Copy slot `src`'s rows of every slot-major tensor [S, ...] in `tensors` to slot `dst` (device
    copies; host-side call between steps, never captured). Every row a slot reads is addressed
    relative to its slot, so afterwards slot dst steps exactly as slot src would have."""
    check_slot(src, slots, "src")
    check_slot(dst, slots, "dst")
    if src != dst:
        for t in tensors:
            t[dst].copy_(t[src])


class StaticState:
    """The static decode state of a whole model for one bucket (`StaticShape`)."""

    def __init__(self, model, shape: StaticShape):
        self.shape = shape
        self.layers = [new_layer_state(layer.attn, shape, model.dtype, model.device) for layer in model.layers]

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every per-slot buffer, slot-major [S, ...] (views of the pools where they live there)."""
        out = []
        for layer in self.layers:
            out.append(layer.window.data)
            for part in (layer.compressor, layer.indexer):
                if part is not None:
                    out += [part.kv.data, part.score.data, part.entries]
        return out

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: copy src's rows of every buffer (see `move_slot`)."""
        move_slot(self.slot_tensors(), self.shape.slots, src, dst)

    def load(self, slot: int, state: DecodeState) -> int:
        """Copy a request's dynamic state (e.g. right after its prefill) into `slot`; returns its length,
        the start position of the slot's next step. Host-side (reads Python counters), not captured."""
        check_slot(slot, self.shape.slots)
        if not isinstance(state, DecodeState) or len(state.layers) != len(self.layers):
            raise ValueError(f"state must be a DecodeState with {len(self.layers)} layers, got {type(state).__name__}")
        length = state.length
        if length + self.shape.tokens > self.shape.max_context:
            raise ValueError(f"state length {length} + tokens per step {self.shape.tokens} exceeds "
                             f"max_context={self.shape.max_context}")
        for static, cache in zip(self.layers, state.layers):
            window = cache.window
            first = window.live_from(length)
            if first < window.start or window.end != length:
                raise ValueError(f"window cache holds positions {window.start}..{window.end}; "
                                 f"length {length} needs {first}..{length}")
            static.window.load(slot, first, window.latents()[first - window.start :])
            for part, dynamic in ((static.compressor, cache.compressor), (static.indexer, cache.indexer)):
                if (part is None) != (dynamic is None):
                    raise ValueError("the decode state's layer kinds do not match the model's")
                if part is not None:
                    part.load(slot, dynamic, length)
        return length
