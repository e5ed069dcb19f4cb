"""Per-request, rewindable decode state of DeepSeek-V4 (docs/design.md "Rewindable decode state").

A `DecodeState` holds, for one request, what future forward calls read (spec §10.1):

* per layer, the window latents (K = V, after kv_norm + RoPE) of the most recent tokens;
* per CSA / HCA layer, the compressor's per-token rows (C, Z + ape) that a future entry still
  pools, and every compressed entry emitted so far; CSA layers have a second compressor (the
  lightning indexer's), whose entries are the indexer keys;
* the token ids fed so far.

Instead of HF's "buffer + overlap half" pair, the compressors keep *per-token rows* from the start
of the previous window on: the incomplete window and the previous window's "a" half are slices of
them, and the number of entries is always `length // m`. Truncation is then just cutting rows.

Layout of one CSA layer at length L, after a forward call that started at length F (= rewind_floor),
window W, rate m (HCA: no previous-window rows; SWA: window only):

    positions  0        (F//m-1)·m   F-W+1        F                    L
               |            |          |          |                    |
    window                             [== latents of F-W+1 .. L-1 ====]   prune: keep >= length-W+1
    rows (C,Z+ape)          [== per-token rows (F//m-1)·m .. L-1 ======]   prune: keep >= (length//m-1)·m
    entries    [e_0 e_1 ... e_{L//m-1}]                                    never pruned (attention reads all)
    tokens     [t_0 ................................................ t_{L-1}]

Pruning happens when a forward call begins (`begin_step`), relative to the length at that moment,
which becomes the new `rewind_floor`. So after the call every length n in [F, L] can still be
restored: `truncate(n)` keeps window latents before n (>= W-1 of them), rows before n (>= the
incomplete window and the previous window's "a" half) and the first n // m entries. Because every
stored value is a per-token (or per-completed-window) quantity, the result holds exactly the values
that feeding those n tokens produced in the verify call.

States are driven by `DeepseekV4ForCausalLM.forward`; one state must not be fed in two modes
(`torch.inference_mode` and plain `no_grad`) alternately on the same buffers — the buffers are
re-allocated if that happens, which is correct but slow.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


class Rows:
    """Rows [n, *tail] with amortised O(1) append, drop-front and truncate (a growable buffer)."""

    def __init__(self, tail: tuple[int, ...], dtype: torch.dtype, device):
        self._data = torch.empty((0, *tail), dtype=dtype, device=device)
        self._lo = 0
        self._hi = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    def view(self) -> torch.Tensor:
        """The live rows [n, *tail] (a view: clone it before the next append if you keep it)."""
        return self._data[self._lo : self._hi]

    def append(self, rows: torch.Tensor) -> None:
        self.reserve(rows.shape[0])[:] = rows

    def reserve(self, n: int) -> torch.Tensor:
        """Make room for n more rows and return them [n, *tail] to be written (`copy_rows`)."""
        # An inference-mode buffer cannot be written outside inference mode: copy it out first.
        foreign = self._data.is_inference() and not torch.is_inference_mode_enabled()
        if self._hi + n > self._data.shape[0] or foreign:
            live = len(self)
            data = torch.empty((max(2 * (live + n), 16), *self._data.shape[1:]), dtype=self._data.dtype,
                               device=self._data.device)
            data[:live] = self.view()
            self._data, self._lo, self._hi = data, 0, live
        self._hi += n
        return self._data[self._hi - n : self._hi]

    def drop_front(self, n: int) -> None:
        self._lo += n

    def keep_first(self, n: int) -> None:
        self._hi = self._lo + n


class WindowCache:
    """Window latents (K = V) of one attention layer for absolute positions [start, end)."""

    def __init__(self, window: int, dim: int, dtype: torch.dtype, device):
        self.window = window
        self.start = 0
        self._rows = Rows((dim,), dtype, device)

    @property
    def end(self) -> int:
        return self.start + len(self._rows)

    def latents(self) -> torch.Tensor:
        """[end − start, d] latents, oldest first."""
        return self._rows.view()

    def append(self, latents: torch.Tensor) -> None:
        self._rows.append(latents)

    def reserve(self, n: int) -> torch.Tensor:
        """Room for the latents [n, d] of the next n positions (write them with `copy_rows`)."""
        return self._rows.reserve(n)

    def prune(self, length: int) -> None:
        """Keep the W − 1 latents before `length`: a query at `length` or later sees no older one."""
        keep_from = max(self.start, length - (self.window - 1))
        self._rows.drop_front(keep_from - self.start)
        self.start = keep_from

    def truncate(self, n: int) -> None:
        self._rows.keep_first(n - self.start)

    def live_from(self, length: int) -> int:
        return max(0, length - (self.window - 1))


class CompressorCache:
    """State of one gated-pooling compressor (spec §8.2, §10) at rate m.

    `kv` rows are C = x·wkvᵀ in the model dtype, `score` rows are Z + ape in fp32, both
    [n, coff·d_c] for absolute positions [rows_start, rows_end); coff = 2 with overlap (CSA: halves
    "a" | "b"), 1 without (HCA). `entries` [n_e, d_c] are the normalised, rotated pooled entries,
    n_e = (number of tokens fed) // m.
    """

    def __init__(self, rate: int, overlap: bool, head_dim: int, dtype: torch.dtype, device):
        self.rate = rate
        self.overlap = overlap
        self.head_dim = head_dim
        width = (2 if overlap else 1) * head_dim
        self.rows_start = 0
        self._kv = Rows((width,), dtype, device)
        self._score = Rows((width,), torch.float32, device)
        self._entries = Rows((head_dim,), dtype, device)

    @property
    def rows_end(self) -> int:
        return self.rows_start + len(self._kv)

    @property
    def n_entries(self) -> int:
        return len(self._entries)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(C rows, Z + ape rows), each [rows_end − rows_start, coff·d_c]."""
        return self._kv.view(), self._score.view()

    def entries(self) -> torch.Tensor:
        """[n_e, d_c] compressed entries, entry w summarising the window ending at (w+1)·m − 1."""
        return self._entries.view()

    def append_rows(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        self._kv.append(kv)
        self._score.append(score)

    def reserve_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the (C, Z + ape) rows of the next n positions (write them with `copy_rows`)."""
        return self._kv.reserve(n), self._score.reserve(n)

    def append_entries(self, entries: torch.Tensor) -> None:
        self._entries.append(entries)

    def reserve_entries(self, n: int) -> torch.Tensor:
        """Room for the next n entries [n, d_c] (write them with `copy_rows`)."""
        return self._entries.reserve(n)

    def live_from(self, length: int) -> int:
        """First position whose rows a future entry can still pool."""
        return max(0, (length // self.rate - int(self.overlap)) * self.rate)

    def prune(self, length: int) -> None:
        keep_from = max(self.rows_start, self.live_from(length))
        self._kv.drop_front(keep_from - self.rows_start)
        self._score.drop_front(keep_from - self.rows_start)
        self.rows_start = keep_from

    def truncate(self, n: int) -> None:
        self._kv.keep_first(n - self.rows_start)
        self._score.keep_first(n - self.rows_start)
        self._entries.keep_first(n // self.rate)


def copy_rows(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i][:] = src[i] for the reserved rows of many requests, as one multi-tensor copy (a ragged
    call appends to B caches per layer: one launch instead of B). Autograd-tracked sources take the
    plain per-tensor copy."""
    if len(dst) == 1 or (torch.is_grad_enabled() and any(s.requires_grad for s in src)):
        for d, s in zip(dst, src):
            d[:] = s
        return
    if dst:
        torch._foreach_copy_(dst, src)


@dataclass
class LayerCache:
    """State of one attention layer: its window, plus its compressor (CSA, HCA) and indexer (CSA)."""

    window: WindowCache
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None

    def parts(self) -> dict[str, WindowCache | CompressorCache]:
        named = {"window": self.window, "compressor": self.compressor, "indexer": self.indexer}
        return {name: part for name, part in named.items() if part is not None}


class DecodeState:
    """Everything one request's future forward calls read; rewindable by `truncate`.

    Attributes: `layers` (one `LayerCache` per attention layer), `length` (tokens fed),
    `rewind_floor` (length before the most recent forward call), `token_ids` [length] (hash routing
    reads the current ids only; kept for Engram-style consumers and for debugging).
    """

    def __init__(self, layers: list[LayerCache], device=None):
        self.layers = layers
        self.rewind_floor = 0
        self._tokens = Rows((), torch.long, device)

    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def token_ids(self) -> torch.Tensor:
        return self._tokens.view()

    def begin_step(self) -> int:
        """Called by the model before appending: fixes the rewind floor, prunes, returns the start position."""
        self.rewind_floor = self.length
        for layer in self.layers:
            for part in layer.parts().values():
                part.prune(self.length)
        return self.length

    def end_step(self, token_ids: torch.Tensor) -> None:
        """Called by the model after every layer appended the new tokens' state."""
        self._tokens.append(token_ids)

    def truncate(self, n_keep: int) -> None:
        """Forget every token after the first `n_keep`, for rewind_floor <= n_keep <= length.

        Afterwards the state equals the one obtained by feeding only those tokens (the kept rows are
        the very values the last call computed for them). Raises ValueError outside that range.
        """
        if isinstance(n_keep, bool) or not isinstance(n_keep, int):
            raise ValueError(f"truncate: n_keep must be an int, got {n_keep!r}")
        if not self.rewind_floor <= n_keep <= self.length:
            raise ValueError(
                f"truncate: n_keep={n_keep} outside [rewind_floor={self.rewind_floor}, length={self.length}]; "
                "state older than the last forward call may have been pruned"
            )
        self._tokens.keep_first(n_keep)
        for layer in self.layers:
            for part in layer.parts().values():
                part.truncate(n_keep)

    def snapshot(self, live_only: bool = False) -> dict[str, torch.Tensor | int]:
        """Copies of all stored tensors and counters, keyed "layers.{i}.{part}.{name}".

        With `live_only`, rows kept only for rewinding are left out: what remains is exactly what
        the next forward call reads, which is independent of the rewind floor.
        """
        out: dict[str, torch.Tensor | int] = {"length": self.length, "tokens": self.token_ids.clone()}
        if not live_only:
            out["rewind_floor"] = self.rewind_floor
        for i, layer in enumerate(self.layers):
            for name, part in layer.parts().items():
                key = f"layers.{i}.{name}"
                if isinstance(part, WindowCache):
                    skip = part.live_from(self.length) - part.start if live_only else 0
                    out[f"{key}.start"] = part.start + skip
                    out[f"{key}.latents"] = part.latents()[skip:].clone()
                    continue
                skip = part.live_from(self.length) - part.rows_start if live_only else 0
                kv, score = part.rows()
                out[f"{key}.rows_start"] = part.rows_start + skip
                out[f"{key}.kv_rows"] = kv[skip:].clone()
                out[f"{key}.score_rows"] = score[skip:].clone()
                out[f"{key}.entries"] = part.entries().clone()
        return out


@dataclass(frozen=True)
class RaggedBatch:
    """Host-planned metadata of one ragged forward call; passed down explicitly.

    Request b owns rows `rows(b)` of the N concatenated new tokens; its first new token sits at
    absolute position `starts[b]` (its length before the call).
    """

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long, absolute position of every row
    seq_lens: tuple[int, ...]
    offsets: tuple[int, ...]
    starts: tuple[int, ...]

    def rows(self, b: int) -> slice:
        return slice(self.offsets[b], self.offsets[b] + self.seq_lens[b])


def plan_batch(input_ids: torch.Tensor, states: list, seq_lens: list[int], n_layers: int,
               device: torch.device) -> RaggedBatch:
    """Validate one ragged call, start a step on every state, build the batch metadata.

    input_ids LongTensor [N]; `states` one `DecodeState` per request, each with `n_layers` layer
    caches; `seq_lens` new tokens per request (>= 1 each, summing to N). Everything is checked
    before the first state is touched, so a rejected call changes nothing. Shared by every model
    family that uses this state layout.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a 1-D LongTensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    seq_lens = [int(n) for n in seq_lens]
    if len(seq_lens) != len(states):
        raise ValueError(f"seq_lens has {len(seq_lens)} entries for {len(states)} states")
    if any(n < 1 for n in seq_lens) or sum(seq_lens) != input_ids.shape[0]:
        raise ValueError(f"seq_lens={seq_lens} must be >= 1 each and sum to len(input_ids)={input_ids.shape[0]}")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("the same DecodeState appears twice in one call")
    wrong = [b for b, s in enumerate(states) if len(s.layers) != n_layers]
    if not states or wrong:
        raise ValueError(f"states {wrong} do not belong to this model ({n_layers} attention layer(s) expected)")
    starts = tuple(state.begin_step() for state in states)
    offsets = tuple(itertools.accumulate(seq_lens[:-1], initial=0))
    first = torch.tensor(starts) - torch.tensor(offsets)  # position of row 0 if request b owned it
    positions = torch.repeat_interleave(first, torch.tensor(seq_lens)) + torch.arange(len(input_ids))
    # non_blocking: a host tensor in pageable memory is staged before the call returns, so nothing
    # here waits for the device (a blocking copy would synchronise the stream every step).
    return RaggedBatch(input_ids.to(device, non_blocking=True), positions.to(device, non_blocking=True),
                       tuple(seq_lens), offsets, starts)


def check_capture(capture_layers, n_layers: int) -> frozenset[int]:
    """Validated `capture_layers` of a forward call: layer ids in [0, n_layers] (n_layers = the final
    streams), shared by every model family."""
    capture = frozenset(int(i) for i in capture_layers)
    bad = [i for i in capture if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(f"capture_layers {sorted(bad)} outside [0, {n_layers}]")
    return capture
