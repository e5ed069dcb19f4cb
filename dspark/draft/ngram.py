"""Prompt-lookup (n-gram) drafting: needs no weights.

The continuation of the most recent earlier occurrence of the current suffix is proposed as the draft
(longest suffix first, `max_ngram` down to `min_ngram`). Deterministic, so verification treats each
draft as a point mass; rejection sampling then accepts x_k with probability p_t(x_k), which keeps the
target distribution exact at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.draft.base import DraftProposal
from dspark.sampling import SamplingParams


@dataclass
class NgramState:
    """Committed token history of one request (prompt + accepted output, anchor excluded)."""

    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafter.

    block_size : γ, tokens proposed per round.
    min_ngram, max_ngram : suffix lengths tried, longest first.
    hit_confidence, miss_confidence : c_k reported for looked-up tokens and for filler tokens (when no
        suffix matches, or the match runs out, the block is padded by repeating the anchor).
    """

    block_size: int = 5
    min_ngram: int = 1
    max_ngram: int = 4
    hit_confidence: float = 0.7
    miss_confidence: float = 0.05
    capture_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def new_state(self) -> NgramState:
        return NgramState()

    def observe(self, dstate: NgramState, token_ids: torch.Tensor, hidden=None, features=None) -> None:
        dstate.tokens.extend(int(t) for t in token_ids.tolist())

    def _lookup(self, history: list[int]) -> list[int]:
        """Tokens that followed the latest earlier match of the longest matching suffix."""
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):
                if history[start:start + n] == suffix:
                    return history[start + n:start + n + self.block_size]
        return []

    def propose(self, dstates: list[NgramState], anchors: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> DraftProposal:
        tokens, conf = [], []
        for dstate, anchor in zip(dstates, anchors):
            found = self._lookup(dstate.tokens + [anchor])
            pad = self.block_size - len(found)
            tokens.append(found + [anchor] * pad)
            conf.append([self.hit_confidence] * len(found) + [self.miss_confidence] * pad)
        return DraftProposal(torch.tensor(tokens, dtype=torch.long), None,
                             torch.tensor(conf, dtype=torch.float32))
