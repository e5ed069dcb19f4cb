"""`TargetCache`: the frozen target's features and logits of each training sequence, kept after
their first use.

The target never changes during `train_draft`, so every later epoch would recompute the very same
rows; keeping them turns each further step into drafter work only. Memory per sequence of length L:
L·(|layers|·n_hc·D + V) values (fp32 features and logits as the target returned them), so this is for
data sets that fit the device (or host) memory it lives in.
"""

from __future__ import annotations

import torch


class TargetCache:
    """Per training-sequence index: (features {ℓ: [L, n_hc, D]}, logits fp32 [L, V])."""

    def __init__(self, target_pass):
        self._pass = target_pass  # (list of ids [L_b]) -> (features {ℓ: [ΣL, n_hc, D]}, logits [ΣL, V])
        self._rows: dict[int, tuple[dict[int, torch.Tensor], torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, indices: list[int], seqs: list[torch.Tensor]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Features and logits of `seqs` (sequence indices[b] = seqs[b]) laid end to end, running the
        target once over the ones not seen yet."""
        missing = [(i, s) for i, s in zip(indices, seqs) if i not in self._rows]
        if missing:
            features, logits = self._pass([s for _, s in missing])
            start = 0
            for i, s in missing:
                rows = slice(start, start + s.shape[0])
                self._rows[i] = ({layer: f[rows] for layer, f in features.items()}, logits[rows])
                start += s.shape[0]
        parts = [self._rows[i] for i in indices]
        layers = parts[0][0].keys()
        return ({layer: torch.cat([p[0][layer] for p in parts]) for layer in layers},
                torch.cat([p[1] for p in parts]))
