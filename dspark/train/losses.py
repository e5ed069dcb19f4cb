"""DSpark training losses (dspark spec §5.5, paper eq. 9–12).

Per supervised slot, with draft p_d = softmax(L_k) (Markov bias included, T = 1), target p_t and
label x*_k:

    ce    = −log p_d(x*_k)
    tv    = ‖p_d − p_t‖₁                        full L1, range [0, 2] (not halved: §11 pitfall 4)
    conf  = BCE-with-logits(z_k, c*_k),  c*_k = clamp(1 − ½‖p_d − p_t‖₁, 0, 1), detached

    L = (0.1·Σ w·ce + 0.9·Σ w·tv + 1.0·Σ w·conf) / Σ w

with w the position weights times the eval mask (`dspark.train.anchors`). The denominator is the
weight of the whole optimizer step (all its sequences), so every supervised slot counts equally
however the step is split into sequences (global token weighting).

Shape symbols: N blocks, γ slots, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0

    def __post_init__(self):
        for name in ("ce", "tv", "conf"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"loss weight {name}: {value!r} must be a number >= 0")


def per_slot_losses(draft_logits: torch.Tensor, conf_logits: torch.Tensor, teacher_probs: torch.Tensor,
                    labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three losses and the analytic acceptance 1 − ½‖p_d − p_t‖₁ per slot, each fp32 [N, γ].

    draft_logits fp32 [N, γ, V]; conf_logits fp32 [N, γ]; teacher_probs fp32 [N, γ, V] (rows sum to 1);
    labels LongTensor [N, γ].
    """
    logits = draft_logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    tv = (logits.softmax(dim=-1) - teacher_probs.float()).abs().sum(dim=-1)
    accept = (1 - 0.5 * tv).clamp(0, 1).detach()
    conf = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
    return {"ce": ce, "tv": tv, "conf": conf, "accept": accept}


def dspark_loss(draft_logits: torch.Tensor, conf_logits: torch.Tensor, teacher_probs: torch.Tensor,
                labels: torch.Tensor, weights: torch.Tensor, loss_weights: LossWeights = LossWeights(),
                normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted DSpark loss of one group of blocks.

    weights fp32 [N, γ] (position weight × eval mask); normalizer: Σ w of the whole optimizer step
    (default: Σ weights). Returns the scalar loss (its share of the step loss) and the group's
    weighted means of ce, tv, conf and the acceptance estimate.
    """
    terms = per_slot_losses(draft_logits, conf_logits, teacher_probs, labels)
    w = weights.to(draft_logits.device, torch.float32)
    total_w = w.sum()
    norm = total_w if normalizer is None else normalizer
    sums = {name: (w * terms[name]).sum() for name in ("ce", "tv", "conf", "accept")}
    loss = (loss_weights.ce * sums["ce"] + loss_weights.tv * sums["tv"] + loss_weights.conf * sums["conf"]) / norm
    denom = float(total_w.clamp_min(1e-12))
    metrics = {name: float(value.detach()) / denom for name, value in sums.items()}
    return loss, metrics


def probabilistic_tau(accept: torch.Tensor, eval_mask: torch.Tensor) -> float:
    """1 + mean over blocks of Σ_k Π_{i≤k} a_i over the supervised prefix (spec §5.5 diagnostic).

    accept fp32 [N, γ] analytic acceptance; eval_mask bool [N, γ].
    """
    if accept.numel() == 0:
        return 1.0
    survival = torch.cumprod(accept * eval_mask, dim=1)
    return 1.0 + float(survival.sum(dim=1).mean())
