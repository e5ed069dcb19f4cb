"""The one key pool of a batched attention call: every request's window and entries, concatenated.

A ragged call attends all its requests in one `sparse_attention` launch. Each request b brings its
window latents (positions start_b .. its last new token, after this call's append) and, on CSA / HCA
layers, its compressed entries; the pool stacks them as

    pool = [ window_0 | window_1 | ... | window_{B-1} | entries_0 | ... | entries_{B-1} ]     [P, d]

and a query row finds its request's keys through two per-row offsets:

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
            self.window_origin, self.entry_offset = origins[0], entry_offsets[0]
            return
        per_request = torch.tensor([origins, entry_offsets], dtype=torch.long)  # [2, B]
        per_row = per_request.repeat_interleave(torch.tensor(batch.seq_lens), dim=1)  # [2, N]
        # Pageable host memory is staged by the driver before the call returns: safe without a sync.
        per_row = per_row.to(batch.positions.device, non_blocking=True)
        self.window_origin, self.entry_offset = per_row[0], per_row[1]

    def pool(self) -> torch.Tensor:
        """[P, d] the concatenated windows and entries (the one part itself when there is only one)."""
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)

    def entry_rows(self, picks: torch.Tensor) -> torch.Tensor:
        """Per-request entry ids [N, k] (−1 = none) -> pool rows [N, k] (−1 kept)."""
        offset = self.entry_offset if isinstance(self.entry_offset, int) else self.entry_offset.unsqueeze(-1)
        return torch.where(picks >= 0, picks + offset, -1)


def _exclusive_cumsum(sizes: list[int], start: int) -> list[int]:
    return list(itertools.accumulate(sizes[:-1], initial=start)) if sizes else []
