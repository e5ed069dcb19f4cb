"""The one key pool of a batched attention call: every request's window and entries, concatenated.

A ragged call attends all its requests in one `sparse_attention` launch. Each request b brings its
window latents (positions start_b .. its last new token, after this call's append) and, on CSA / HCA
layers, its compressed entries; the pool stacks them as

    pool = [ window_0 | window_1 | ... | window_{B-1} | entries_0 | ... | entries_{B-1} ]     [P, d]

and a query row finds its request's keys through per-row offsets:

    window_start  [N]   first position held in the row's request's window (older keys: none)
    window_origin [N]   position p of the row's request sits at pool row p − window_origin
    entry_offset  [N]   entry w of the row's request sits at pool row entry_offset + w

The offsets come from host-side sizes (the caches' Python counters): one small host-to-device copy,
no device sync. With one request they stay Python ints and nothing is copied to the device.
"""

from __future__ import annotations

import itertools

import torch

from dspark.models.deepseek_v4.state import RaggedBatch


class RequestPool:
    """Pool layout of one batched attention call (see the module docstring).

    windows  per request [n_b, d] window latents, oldest first, the first at position window_starts[b]
    entries  per request [T_b, d] compressed entries (empty list on sliding-window layers)
    """

    def __init__(self, batch: RaggedBatch, window_starts: list[int], windows: list[torch.Tensor],
                 entries: list[torch.Tensor]):
        self._parts = [*windows, *entries]
        window_rows = [w.shape[0] for w in windows]
        entry_rows = [e.shape[0] for e in entries]
        self.max_entries = max(entry_rows, default=0)  # T_max: width of an all-entries key list
        window_offsets = _exclusive_cumsum(window_rows, 0)
        entry_offsets = _exclusive_cumsum(entry_rows, sum(window_rows)) if entries else [0] * len(windows)
        origins = [start - offset for start, offset in zip(window_starts, window_offsets)]
        if len(windows) == 1:
            self.window_start, self.window_origin, self.entry_offset = window_starts[0], origins[0], entry_offsets[0]
            return
        per_request = torch.tensor([window_starts, origins, entry_offsets], dtype=torch.long)  # [3, B]
        per_row = per_request.repeat_interleave(torch.tensor(batch.seq_lens), dim=1)  # [3, N]
        # Pageable host memory is staged by the driver before the call returns: safe without a sync.
        per_row = per_row.to(batch.positions.device, non_blocking=True)
        self.window_start, self.window_origin, self.entry_offset = per_row[0], per_row[1], per_row[2]

    def pool(self) -> torch.Tensor:
        """[P, d] the concatenated windows and entries (the one part itself when there is only one)."""
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)

    def window_index(self, positions: torch.Tensor, window: int) -> torch.Tensor:
        """[N, W] pool rows of keys p−W+1 .. p of every row; −1 before its window's start (position
        < 0, or older than what the window holds, e.g. after a V4.1 bounded-replay restart)."""
        keys = positions.unsqueeze(-1) - (window - 1) + torch.arange(window, device=positions.device)
        return torch.where(keys >= _column(self.window_start), keys - _column(self.window_origin), -1)

    def entry_rows(self, picks: torch.Tensor) -> torch.Tensor:
        """Per-request entry ids [N, k] (−1 = none) -> pool rows [N, k] (−1 kept)."""
        return torch.where(picks >= 0, picks + _column(self.entry_offset), -1)


def _column(value: int | torch.Tensor) -> int | torch.Tensor:
    """A per-row value [N] as a column [N, 1] (ints broadcast as they are)."""
    return value if isinstance(value, int) else value.unsqueeze(-1)


def _exclusive_cumsum(sizes: list[int], start: int) -> list[int]:
    return list(itertools.accumulate(sizes[:-1], initial=start)) if sizes else []
