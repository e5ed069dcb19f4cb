"""DSpark confidence head (dspark spec §1.7, §7.2): c_k = σ(proj([x_k ; W1[x_{k−1}]])).

c_k estimates the probability that draft x_k survives verification given that x_0..x_{k−1} did; the
planner reads the survival a_k = Π_{i≤k} c_i. On V4 the input is the *pre-norm* hc-collapsed hidden
x_k of the last stage (not the normalised h_k that feeds the LM head) concatenated with the Markov
embedding of the token before x_k (the anchor for k = 0) — the token actually sampled, so c_k is
computed after the Markov loop. `proj` has no bias (V4 checkpoint `confidence_head.proj` [1, D + r])
and runs in fp32. Without the Markov embedding (`dspark_confidence_with_markov=False`) it is [1, D].

Raw logits z_k are what training (BCE with logits) and STS calibration (`StsCalibration.apply`:
σ(z_k / T_k)) consume.

Shape symbols: B requests (or blocks), γ slots, D hidden size, r Markov rank.
"""

from __future__ import annotations

import torch
from torch import nn


class ConfidenceHead(nn.Module):
    """`proj` Linear(D (+ r) -> 1, no bias), fp32."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool, device=None):
        super().__init__()
        self.with_markov = with_markov
        width = hidden_size + (rank if with_markov else 0)
        self.proj = nn.Linear(width, 1, bias=False, dtype=torch.float32, device=device)

    def forward(self, hidden: torch.Tensor, prev_embeddings: torch.Tensor) -> torch.Tensor:
        """Raw logits z_k: hidden [..., D] (pre-norm collapse), prev_embeddings fp32 [..., r] -> fp32 [...]."""
        x = hidden.float()
        if self.with_markov:
            x = torch.cat((x, prev_embeddings.float()), dim=-1)
        return self.proj(x).squeeze(-1)
