"""Per-request, rewindable decode state of DeepSeek-V4.1 (docs/design.md "Rewindable decode state").

On top of V4's per-layer windows (`LayerCache.window`, one per layer; V4.1 layers own no
compressor of their own), a V4.1 request keeps the state that CSA2 shares across layers and the
Engram history (deepseek_v41 spec §5.5, §8.3):

* `sources[l]` for every KV-source layer l: the ratio-2 compressor's per-token rows of the
  incomplete group (kv and gate, fp32), the compressed entries (after RoPE + FP4 QAT) and the
  index keys (after RoPE + FP4 QAT) that every later layer up to the next source reads;
* `ngram`: the compressed token ids of the last N − 1 positions (N = engram_max_ngram_size), with
  DEAD (−1) for image-span tokens.

Layout of one ratio-2 source at length L after a call that started at F (= rewind_floor):

    positions  0            2·(F//2)        F                    L
    rows (kv, gate)         [== rows 2·(F//2) .. L-1 ============]   prune: keep >= 2·(length//2)
    entries    [e_0 ...................................... e_{L//2-1}]  never pruned
    index keys [k_0 ...................................... k_{L//2-1}]  never pruned
    ngram ids                        [== ids F-N+1 .. L-1 ==========]   prune: keep >= length-N+1

Pruning happens at `begin_step`, so every length in [F, L] stays restorable by `truncate`, which
keeps the first rows / the first n // ratio entries: exactly the values feeding n tokens produced.

Bounded replay (spec §6.2) is the exception: a call whose decoder layers skipped rows is not
rewindable (its end becomes the rewind floor), because its decoder windows are not those of any
shorter call.
"""

from __future__ import annotations

import torch

from dspark.models.deepseek_v4.state import DecodeState, LayerCache, Rows, WindowCache


class SourceCache:
    """Global state published by one KV-source layer at compression ratio `rate`.

    kv_rows, gate_rows  fp32 [n, d] per-token compressor rows of positions [rows_start, rows_end)
                        (ratio > 1 only: the incomplete group is pooled once it is complete)
    entries             [n_e, d] compressed KV, entry j at position j·rate, n_e = length // rate
    index_keys          [n_e, di] index keys of the same entries
    """

    def __init__(self, rate: int, head_dim: int, index_dim: int, dtype: torch.dtype, device):
        self.rate = rate
        self.pooled = rate > 1
        self.rows_start = 0
        self._kv = Rows((head_dim,), torch.float32, device)
        self._gate = Rows((head_dim,), torch.float32, device)
        self._entries = Rows((head_dim,), dtype, device)
        self._keys = Rows((index_dim,), dtype, device)

    @property
    def rows_end(self) -> int:
        return self.rows_start + len(self._kv)

    @property
    def n_entries(self) -> int:
        return len(self._entries)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv rows, gate rows), each fp32 [rows_end − rows_start, d]."""
        return self._kv.view(), self._gate.view()

    def entries(self) -> torch.Tensor:
        return self._entries.view()

    def index_keys(self) -> torch.Tensor:
        return self._keys.view()

    def append_rows(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        self._kv.append(kv)
        self._gate.append(gate)

    def append_entries(self, entries: torch.Tensor, keys: torch.Tensor) -> None:
        self._entries.append(entries)
        self._keys.append(keys)

    def reserve_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the (kv, gate) rows of the next n positions (write them with `copy_rows`)."""
        return self._kv.reserve(n), self._gate.reserve(n)

    def reserve_entries(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the next n (entries, index keys) (write them with `copy_rows`)."""
        return self._entries.reserve(n), self._keys.reserve(n)

    def live_from(self, length: int) -> int:
        """First position whose rows a future entry still pools (the incomplete group's start)."""
        return (length // self.rate) * self.rate

    def prune(self, length: int) -> None:
        if self.pooled:
            keep_from = max(self.rows_start, self.live_from(length))
            self._kv.drop_front(keep_from - self.rows_start)
            self._gate.drop_front(keep_from - self.rows_start)
            self.rows_start = keep_from

    def truncate(self, n: int) -> None:
        if self.pooled:
            self._kv.keep_first(n - self.rows_start)
            self._gate.keep_first(n - self.rows_start)
        self._entries.keep_first(n // self.rate)
        self._keys.keep_first(n // self.rate)

    def snapshot(self, length: int, live_only: bool) -> dict[str, torch.Tensor | int]:
        skip = self.live_from(length) - self.rows_start if live_only and self.pooled else 0
        kv, gate = self.rows()
        return {"rows_start": self.rows_start + skip, "kv_rows": kv[skip:].clone(), "gate_rows": gate[skip:].clone(),
                "entries": self.entries().clone(), "index_keys": self.index_keys().clone()}


class NgramHistory:
    """Compressed token ids (DEAD = −1 for image-span tokens) of positions [start, end)."""

    def __init__(self, keep: int, device):
        self.keep = keep  # N − 1: the look-back of the longest n-gram
        self.start = 0
        self._ids = Rows((), torch.long, device)

    @property
    def end(self) -> int:
        return self.start + len(self._ids)

    def recent(self) -> torch.Tensor:
        """[<= N − 1] ids of the positions just before `end` (fewer at the sequence start)."""
        ids = self._ids.view()
        return ids[max(0, ids.shape[0] - self.keep):]

    def append(self, ids: torch.Tensor) -> None:
        self._ids.append(ids)

    def live_from(self, length: int) -> int:
        return max(0, length - self.keep)

    def prune(self, length: int) -> None:
        keep_from = max(self.start, self.live_from(length))
        self._ids.drop_front(keep_from - self.start)
        self.start = keep_from

    def truncate(self, n: int) -> None:
        self._ids.keep_first(n - self.start)

    def snapshot(self, length: int, live_only: bool) -> dict[str, torch.Tensor | int]:
        skip = self.live_from(length) - self.start if live_only else 0
        return {"start": self.start + skip, "ids": self._ids.view()[skip:].clone()}


class DecodeStateV41(DecodeState):
    """A V4.1 request's state: per-layer windows (`layers`), shared sources, Engram history.

    Same contract as V4's `DecodeState` (`length`, `rewind_floor`, `truncate`, `snapshot`); the
    snapshot adds "sources.{l}.{rows_start, kv_rows, gate_rows, entries, index_keys}" and
    "ngram.{start, ids}".
    """

    def __init__(self, layers: list[LayerCache], sources: dict[int, SourceCache], ngram: NgramHistory | None,
                 device=None):
        super().__init__(layers, device)
        self.sources = sources
        self.ngram = ngram

    def _shared(self) -> dict[str, SourceCache | NgramHistory]:
        parts: dict[str, SourceCache | NgramHistory] = {f"sources.{i}": s for i, s in self.sources.items()}
        if self.ngram is not None:
            parts["ngram"] = self.ngram
        return parts

    def begin_step(self) -> int:
        start = super().begin_step()
        for part in self._shared().values():
            part.prune(start)
        return start

    def end_step(self, token_ids: torch.Tensor, compressed_ids: torch.Tensor | None = None,
                 rewindable: bool = True) -> None:
        """After every layer appended: record the tokens and their Engram ids. A call that is not
        `rewindable` (bounded replay skipped rows) moves the rewind floor to its end."""
        super().end_step(token_ids)
        if self.ngram is not None:
            self.ngram.append(compressed_ids)
        if not rewindable:
            self.rewind_floor = self.length

    def restart_windows(self, layer_ids, position: int) -> None:
        """Empty the windows of `layer_ids`; their next latent sits at `position` (bounded replay's
        SWA read floor: a replayed query never sees decoder latents before the replayed rows)."""
        for i in layer_ids:
            old = self.layers[i].window
            window = WindowCache(old.window, old.latents().shape[-1], old.latents().dtype, old.latents().device)
            window.start = position
            self.layers[i].window = window

    def truncate(self, n_keep: int) -> None:
        super().truncate(n_keep)  # validates n_keep before anything changes
        for part in self._shared().values():
            part.truncate(n_keep)

    def snapshot(self, live_only: bool = False) -> dict[str, torch.Tensor | int]:
        out = super().snapshot(live_only)
        for name, part in self._shared().items():
            out.update({f"{name}.{key}": value for key, value in part.snapshot(self.length, live_only).items()})
        return out
