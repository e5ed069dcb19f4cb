"""Sequential Temperature Scaling (STS): calibrate the confidence head per draft position.

The planner needs calibrated *absolute* survival probabilities, and the raw head is over-confident
(paper §3.2.1, spec §4.4). STS learns one temperature per position, c_k = σ(z_k / T_k), from
verify-all rounds (no truncation, otherwise the labels are censored) recorded at the serving
temperature: the raw confidence logits z_{n,k} and the accepted-draft count A_n of each round.

Two objectives:

* ``"nll"`` (default): maximum likelihood of the observed counts under the survival model
  P(A >= k + 1) = Π_{i<=k} c_i. The likelihood factorises over positions: position k only sees the
  rounds whose first k drafts were accepted, with label 1[A > k]. Each T_k is therefore a separate
  1-D problem, convex in 1/T_k (logistic regression with a single weight and no bias) and hence
  unimodal in log T_k, solved by golden-section search.
* ``"ece"``: the paper's procedure. Positions in order; T_k by grid search (200 log-spaced values in
  [0.1, 10]) minimising the ECE of the prefix product Π_{i<=k} σ(z_i / T_i) against 1[A > k], with
  T_{<k} fixed.

Scaling by a positive temperature preserves the order of the logits at each position, so AUROC is
unchanged; only calibration moves.

Shape symbols: N recorded rounds, γ block size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FORMAT = "dspark-sts/1"
_ECE_GRID = tuple(10.0 ** (-1.0 + 2.0 * i / 199) for i in range(200))  # T in [0.1, 10], log-spaced
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class StsCalibration:
    """Per-position temperatures for the confidence head.

    Parameters
    ----------
    temperatures : tuple[float, ...] of length γ, each finite and > 0
    objective : "nll", "ece" or "identity"
    dataset : str, where the calibration rounds came from
    num_samples : int, rounds used
    ece_before, ece_after : tuple[float, ...], per-position prefix ECE before and after (or empty)
    """

    temperatures: tuple[float, ...]
    objective: str = "identity"
    dataset: str = ""
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()

    def __post_init__(self):
        temps = tuple(float(t) for t in self.temperatures)
        if not temps or any(not math.isfinite(t) or t <= 0 for t in temps):
            raise ValueError(f"temperatures must be a non-empty sequence of finite values > 0, got {temps}")
        if self.objective not in ("nll", "ece", "identity"):
            raise ValueError(f"objective must be 'nll', 'ece' or 'identity', got {self.objective!r}")
        for name in ("ece_before", "ece_after"):
            vals = tuple(float(v) for v in getattr(self, name))
            if vals and len(vals) != len(temps):
                raise ValueError(f"{name} must be empty or have γ={len(temps)} entries, got {len(vals)}")
            object.__setattr__(self, name, vals)
        object.__setattr__(self, "temperatures", temps)

    @classmethod
    def identity(cls, gamma: int) -> StsCalibration:
        """T_k = 1 for all γ positions (the raw head)."""
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
        return cls((1.0,) * gamma)

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences σ(z_k / T_k).

        Shape: logits floating [..., γ] (γ must match) -> same dtype and shape.
        """
        if not torch.is_floating_point(logits) or logits.dim() < 1 or logits.shape[-1] != self.gamma:
            raise ValueError(f"logits must be floating [..., γ={self.gamma}], got {logits.dtype} "
                             f"{tuple(logits.shape)}")
        return self.apply_first(logits)

    def apply_first(self, logits: torch.Tensor) -> torch.Tensor:
        """σ(z_k / T_k) of the first k positions, for a block drafted only that far (k = 1 .. γ).

        Shape: logits floating [..., k] -> same dtype and shape.
        """
        if not torch.is_floating_point(logits) or logits.dim() < 1 or not 1 <= logits.shape[-1] <= self.gamma:
            raise ValueError(f"logits must be floating [..., k] with 1 <= k <= γ={self.gamma}, got {logits.dtype} "
                             f"{tuple(logits.shape)}")
        temps = torch.tensor(self.temperatures[:logits.shape[-1]], dtype=logits.dtype, device=logits.device)
        return torch.sigmoid(logits / temps)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "temperatures": list(self.temperatures), "objective": self.objective,
                "dataset": self.dataset, "num_samples": self.num_samples,
                "ece_before": list(self.ece_before), "ece_after": list(self.ece_after)}

    @classmethod
    def from_dict(cls, data: dict) -> StsCalibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT or "temperatures" not in data:
            raise ValueError(f"not an STS calibration: expected format {FORMAT!r} with 'temperatures'")
        return cls(tuple(data["temperatures"]), data.get("objective", "identity"), data.get("dataset", ""),
                   int(data.get("num_samples", 0)), tuple(data.get("ece_before", ())),
                   tuple(data.get("ece_after", ())))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike, gamma: int | None = None) -> StsCalibration:
        """Load from JSON; with `gamma`, refuse a calibration fitted for another block size."""
        with open(path) as f:
            cal = cls.from_dict(json.load(f))
        if gamma is not None and cal.gamma != gamma:
            raise ValueError(f"{path}: calibration has γ={cal.gamma}, runtime γ={gamma}; refit STS")
        return cal


def prefix_labels(num_accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """y[n, k] = 1[num_accepted[n] > k]: draft k of round n was accepted (with all before it).

    Shape: num_accepted integer [N] in [0, γ] -> float64 [N, γ].
    """
    if num_accepted.dim() != 1 or torch.is_floating_point(num_accepted):
        raise ValueError(f"num_accepted must be an integer tensor [N], got {num_accepted.dtype} "
                         f"{tuple(num_accepted.shape)}")
    if num_accepted.numel() and (num_accepted.min() < 0 or num_accepted.max() > gamma):
        raise ValueError(f"num_accepted values must lie in [0, γ={gamma}]")
    return (num_accepted.cpu()[:, None] > torch.arange(gamma)[None, :]).double()


def expected_calibration_error(pred: torch.Tensor, label: torch.Tensor, num_bins: int = 20) -> float:
    """ECE with `num_bins` equal-width bins on [0, 1]: Σ_b (n_b / N) |mean pred_b − mean label_b|.

    Shapes: pred, label floating [N] (pred in [0, 1], label in {0, 1} or [0, 1]). Returns 0 for N = 0.
    """
    if pred.shape != label.shape or pred.dim() != 1:
        raise ValueError(f"pred and label must both be [N], got {tuple(pred.shape)} and {tuple(label.shape)}")
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    n = pred.numel()
    if n == 0:
        return 0.0
    p, y = pred.double().cpu(), label.double().cpu()
    bins = (p * num_bins).long().clamp(0, num_bins - 1)  # [N]
    sum_p = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, p)
    sum_y = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, y)
    # |mean p − mean y| · n_b / N = |Σ p − Σ y| / N, so empty bins contribute 0 without a division.
    return float((sum_p - sum_y).abs().sum() / n)


def prefix_ece(logits: torch.Tensor, num_accepted: torch.Tensor, temperatures: Sequence[float],
               num_bins: int = 20) -> tuple[float, ...]:
    """Per-position ECE of the survival Π_{i<=k} σ(z_i / T_i) against 1[A > k] (spec §6 metric).

    Shapes: logits floating [N, γ]; num_accepted integer [N]; temperatures γ floats. Returns γ floats.
    """
    z, y = _check_data(logits, num_accepted)
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float64)
    if temps.numel() != z.shape[1]:
        raise ValueError(f"got {temps.numel()} temperatures for γ={z.shape[1]}")
    surv = torch.cumprod(torch.sigmoid(z / temps), dim=1)
    return tuple(expected_calibration_error(surv[:, k], y[:, k], num_bins) for k in range(z.shape[1]))


def fit_sts(logits: torch.Tensor, num_accepted: torch.Tensor, objective: str = "nll", dataset: str = "",
            bounds: tuple[float, float] = (0.05, 20.0), num_bins: int = 20) -> StsCalibration:
    """Fit one temperature per draft position (module docstring for the two objectives).

    Parameters
    ----------
    logits : floating [N, γ]
        Raw confidence-head logits of verify-all rounds.
    num_accepted : integer [N] in [0, γ]
        Accepted drafts of each round.
    objective : "nll" or "ece"
    dataset : str, recorded in the result
    bounds : (lo, hi), search interval for T under "nll"
    num_bins : ECE bins (for "ece" and the reported before/after values)

    Returns
    -------
    StsCalibration
        A position no round reached (no data for its conditional) keeps T = 1.
    """
    if objective not in ("nll", "ece"):
        raise ValueError(f"objective must be 'nll' or 'ece', got {objective!r}")
    lo, hi = (float(b) for b in bounds)
    if not 0 < lo < hi or not math.isfinite(hi):
        raise ValueError(f"bounds must satisfy 0 < lo < hi < inf, got {bounds}")
    z, y = _check_data(logits, num_accepted)
    gamma = z.shape[1]
    temps: list[float] = []
    for k in range(gamma):
        if objective == "nll":
            reached = y[:, k - 1] > 0 if k > 0 else torch.ones(z.shape[0], dtype=torch.bool)
            temps.append(_fit_nll(z[reached, k], y[reached, k], lo, hi))
        else:
            temps.append(_fit_ece(z[:, :k + 1], y[:, k], temps, num_bins))
    return StsCalibration(tuple(temps), objective, dataset, z.shape[0],
                          prefix_ece(z, num_accepted, (1.0,) * gamma, num_bins),
                          prefix_ece(z, num_accepted, temps, num_bins))


def confidence_nll(logits: torch.Tensor, num_accepted: torch.Tensor, temperatures: Sequence[float]) -> float:
    """Mean negative log-likelihood of the accepted counts under c_k = σ(z_k / T_k).

    -log P(A = a) = -Σ_{k<a} log c_k − log(1 − c_a) (last term absent when a = γ), averaged over rounds.
    Shapes: logits floating [N, γ]; num_accepted integer [N]; temperatures γ floats.
    """
    z, y = _check_data(logits, num_accepted)
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float64)
    if temps.numel() != z.shape[1]:
        raise ValueError(f"got {temps.numel()} temperatures for γ={z.shape[1]}")
    reached = torch.cat([torch.ones_like(y[:, :1]), y[:, :-1]], dim=1)  # [N, γ] position k was judged
    bce = F.binary_cross_entropy_with_logits(z / temps, y, reduction="none")
    return float((bce * reached).sum() / max(z.shape[0], 1))


def _check_data(logits: torch.Tensor, num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.is_floating_point(logits) or logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be floating [N, γ], got {logits.dtype} {tuple(logits.shape)}")
    if num_accepted.shape != logits.shape[:1]:
        raise ValueError(f"num_accepted must be [N={logits.shape[0]}], got {tuple(num_accepted.shape)}")
    z = logits.detach().double().cpu()
    if not torch.isfinite(z).all():
        raise ValueError("logits must be finite")
    return z, prefix_labels(num_accepted, logits.shape[1])


def _fit_nll(z: torch.Tensor, y: torch.Tensor, lo: float, hi: float) -> float:
    """argmin over T in [lo, hi] of Σ BCE(z / T, y), golden-section search on log T.

    Shapes: z, y float64 [M]. Returns 1.0 when M = 0.
    """
    if z.numel() == 0:
        return 1.0

    def loss(log_t: float) -> float:
        return float(F.binary_cross_entropy_with_logits(z * math.exp(-log_t), y, reduction="sum"))

    a, b = math.log(lo), math.log(hi)
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > 1e-6:  # ~ 45 iterations from [log 0.05, log 20]
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = loss(d)
    return math.exp((a + b) / 2)


def _fit_ece(z: torch.Tensor, y: torch.Tensor, fixed: list[float], num_bins: int) -> float:
    """Grid search of T_k minimising the prefix ECE with T_{<k} = `fixed` (the paper's STS step).

    Shapes: z float64 [N, k+1]; y float64 [N]. Ties go to the grid value closest to 1.
    """
    earlier = torch.ones(z.shape[0], dtype=torch.float64)
    if fixed:
        earlier = torch.cumprod(torch.sigmoid(z[:, :-1] / torch.tensor(fixed, dtype=torch.float64)), 1)[:, -1]
    grid = sorted(_ECE_GRID, key=lambda t: abs(math.log(t)))
    best_t, best = 1.0, expected_calibration_error(earlier * torch.sigmoid(z[:, -1]), y, num_bins)
    for t in grid:
        ece = expected_calibration_error(earlier * torch.sigmoid(z[:, -1] / t), y, num_bins)
        if ece < best:
            best_t, best = t, ece
    return best_t
