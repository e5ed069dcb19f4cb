"""The DSpark draft state: each request's committed context, limited to the sliding window.

Every stage attends to at most the last W committed positions (spec §2.5, "SWA-limited"), so a
request's draft state is, per stage, the context keys of its last ≤ W committed rows — nothing else.
Rows enter only through `DSparkDrafter.observe` (committed target rows: prompt chunks, then the
anchor plus the accepted drafts of each round); `propose` reads the state and computes the block's
own keys transiently, so the state never holds anything speculative and needs no rollback.

Layout of one request at length L (= position of the next anchor), window W:

    positions   0 ....... L−W ............. L−1 | L (anchor)  L+1 .. L+γ−1 (noise slots)
    latents[s]            [=== ≤ W rows ====]   |  block keys: computed in `propose`, never stored

The same visibility, written as pool indices (`window_rows`), serves inference (a pool of every
request's cached rows) and training (a pool of one sequence's rows at all positions): query slots
of the block anchored at a see context positions a − W .. a − 1, in that order, −1 for missing ones.

Shape symbols: B requests, W window, d head_dim, n rows.
"""

from __future__ import annotations

import torch


class DSparkState:
    """Committed context of one request.

    length : committed rows observed so far (= absolute position of the next anchor).
    latents : per stage, the keys of positions `start .. length − 1`, [length − start, d], ≤ W rows.
    """

    def __init__(self, num_stages: int, window: int):
        self.window = window
        self.length = 0
        self.latents: list[torch.Tensor | None] = [None] * num_stages

    @property
    def rows(self) -> int:
        return 0 if self.latents[0] is None else self.latents[0].shape[0]

    @property
    def start(self) -> int:
        return self.length - self.rows

    def append(self, latents: list[torch.Tensor], n_new: int) -> None:
        """Add the keys of the newest rows and drop what falls out of the window.

        `n_new` rows were committed; `latents[s]` [m, d] holds the keys of the last m ≤ n_new of them
        (older ones would be pruned at once, so the caller need not compute them).
        """
        self.length += n_new
        for s, new in enumerate(latents):
            old = self.latents[s]
            joined = new if old is None or new.shape[0] >= self.window else torch.cat((old, new))
            # Slicing keeps a view: clone so a long prompt's buffer is not kept alive by W rows.
            self.latents[s] = joined[-self.window:].clone() if joined.shape[0] > self.window else joined

    def snapshot(self) -> dict:
        """Copies of everything the state holds (for tests: propose must not change it)."""
        return {"length": self.length, "latents": [None if t is None else t.clone() for t in self.latents]}


def window_rows(anchor_positions: torch.Tensor, window: int, first_position: torch.Tensor,
                pool_offset: torch.Tensor) -> torch.Tensor:
    """[B, W] pool rows of context positions a − W .. a − 1 for each anchor a; −1 where absent.

    anchor_positions [B]; first_position [B]: the oldest position the pool holds for that row's
    request; pool_offset [B]: pool row of that oldest position. Positions before `first_position`
    (pruned, or before 0) are absent.
    """
    positions = anchor_positions[:, None] - window + torch.arange(window, device=anchor_positions.device)
    present = positions >= first_position[:, None]
    return torch.where(present, positions - first_position[:, None] + pool_offset[:, None], -1)


def gather_context(states: list[DSparkState], window: int, head_dim: int, dtype: torch.dtype,
                   device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One key pool per stage over the requests' cached rows, and each request's visible rows.

    Returns (pools: per stage [Σ rows_b, d], index LongTensor [B, W]). A request with no committed row
    yet contributes nothing and sees no context.
    """
    rows = [s.rows for s in states]
    offsets = torch.tensor([sum(rows[:b]) for b in range(len(rows))], device=device)
    anchors = torch.tensor([s.length for s in states], device=device)
    starts = torch.tensor([s.start for s in states], device=device)
    index = window_rows(anchors, window, starts, offsets)
    pools = []
    for stage in range(len(states[0].latents)):
        parts = [s.latents[stage] for s in states if s.latents[stage] is not None]
        pools.append(torch.cat(parts).to(device) if parts else torch.zeros(0, head_dim, dtype=dtype, device=device))
    return pools, index
