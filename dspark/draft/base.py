"""The drafter interface shared by DSpark, MTP-1 and n-gram drafting (see docs/design.md).

Shape symbols: B requests, γ block size (drafted tokens per round), k ≤ γ the tokens one proposal
holds (γ unless the caller asked a DSpark drafter for fewer), V vocabulary, n committed rows in one
`observe` call, n_hc residual streams, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.sampling import SamplingParams


@dataclass(frozen=True)
class DraftProposal:
    """One round of drafts for a batch of requests.

    tokens : LongTensor [B, k]
        Drafted tokens x_0..x_{k-1}: the full block (k = γ), or its first k slots when the caller
        verifies no more (`DSparkDrafter.propose`'s `n_draft`, a static drafter built for k).
    probs : float32 [B, k, V] or None
        The distribution each token was sampled from (q in rejection sampling); None for a
        deterministic drafter, whose proposal is then a point mass on `tokens`.
    confidence : float32 [B, k]
        c_k: the drafter's estimate that x_k survives verification given x_0..x_{k-1} did.
    confidence_logits : float32 [B, k] or None
        The raw head logits z_k before calibration (c_k = σ(z_k / T_k)), for drafters with a
        confidence head; what STS calibration records.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor
    confidence_logits: torch.Tensor | None = None

    def __post_init__(self):
        if self.tokens.dim() != 2 or self.confidence.shape != self.tokens.shape:
            raise ValueError(f"DraftProposal: tokens {tuple(self.tokens.shape)} and confidence "
                             f"{tuple(self.confidence.shape)} must both be [B, k]")
        if self.probs is not None and self.probs.shape[:2] != self.tokens.shape:
            raise ValueError(f"DraftProposal: probs {tuple(self.probs.shape)} must be [B, k, V]")
        if self.confidence_logits is not None and self.confidence_logits.shape != self.tokens.shape:
            raise ValueError(f"DraftProposal: confidence_logits {tuple(self.confidence_logits.shape)} must be [B, k]")


class Drafter(Protocol):
    """What the generate loop needs from a drafter.

    `observe` sees only committed target rows (prompt rows after prefill; anchor plus accepted drafts
    after a verify), so a draft state never holds anything speculative and needs no rollback.
    `propose` must leave every draft state unchanged.
    """

    block_size: int
    capture_layers: tuple[int, ...]

    def new_state(self): ...

    def observe(self, dstate, token_ids: torch.Tensor, hidden: torch.Tensor,
                features: dict[int, torch.Tensor]) -> None: ...

    def propose(self, dstates: list, anchors: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> DraftProposal: ...
