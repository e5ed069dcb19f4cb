"""Sequential Temperature Scaling (STS): calibrate the confidence head per draft position.

The planner needs calibrated *absolute* survival probabilities, and the raw head is over-confident
(paper §3.2.1, spec §4.4). STS learns one temperature per position, c_k = σ(z_k / T_k), from
verify-all rounds (no truncation, otherwise the labels are censored) recorded at the serving
temperature: the raw confidence logits z_{n,k} and the accepted-draft count A_n of each round.

Three objectives:

* ``"nll"`` (default): maximum likelihood of the observed counts under the survival model
  P(A >= k + 1) = Π_{i<=k} c_i. The likelihood factorises over positions: position k only sees the
  rounds whose first k drafts were accepted, with label 1[A > k]. Each T_k is therefore a separate
  1-D problem, convex in 1/T_k (logistic regression with a single weight and no bias) and hence
  unimodal in log T_k, solved by golden-section search.
* ``"ece"``: the paper's procedure. Positions in order; T_k by grid search (200 log-spaced values in
  [0.1, 10]) minimising the ECE of the prefix product Π_{i<=k} σ(z_i / T_i) against 1[A > k], with
  T_{<k} fixed.
* ``"affine"`` (our extension, not the paper's): c_k = σ(z_k / T_k + b_k), one temperature and one
  bias per position, maximum likelihood as under "nll" (per position a two-parameter logistic
  regression, convex, solved by Newton's method; 1/T_k kept >= 1/20). A temperature alone cannot move
  the mean confidence across 1/2, and a weak head's mean is where it is most wrong: dspark-tiny's head
  has mean logits > 0 at every position, so at temperature 1, where its first draft survives a third
  of the time, the best temperature still predicts about one half (and at temperature 0, where drafts
  survive more often than its σ(z) says, the best temperature cannot raise them). The planner prices
  every draft by its absolute survival, so the bias is what lets it choose right between drafting
  and plain decoding.

Acceptance depends on the sampling temperature (greedy verification accepts a draft that equals the
target's argmax, sampled verification with probability min(1, p/q)), so a calibration is fitted at
one serving temperature and records it (`sampling_temperature`); a drafter holds one for greedy
requests and one for sampled requests (`DSparkDrafter.calibration_for`).

Scaling by a positive temperature (and adding a bias) preserves the order of the logits at each
position, so AUROC is unchanged; only calibration moves.

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
OBJECTIVES = ("nll", "ece", "affine")
_ECE_GRID = tuple(10.0 ** (-1.0 + 2.0 * i / 199) for i in range(200))  # T in [0.1, 10], log-spaced
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class StsCalibration:
    """Per-position temperatures for the confidence head.

    Parameters
    ----------
    temperatures : tuple[float, ...] of length γ, each finite and > 0
    objective : "nll", "ece", "affine" or "identity"
    dataset : str, where the calibration rounds came from
    num_samples : int, rounds used
    ece_before, ece_after : tuple[float, ...], per-position prefix ECE before and after (or empty)
    biases : tuple[float, ...] of length γ (finite), or empty for all 0 (the paper's STS)
    sampling_temperature : the sampling temperature the rounds were recorded at (0 = greedy), or None
        when unknown
    acceptance : tuple[float, ...] of length γ in [0, 1], or empty: the calibration rounds' empirical
        conditional acceptance P(A > k | A >= k) per position, whose running product is their mean
        survival; the asynchronous planner's prior for a request that has no confidences yet
        (`dspark.round`)
    """

    temperatures: tuple[float, ...]
    objective: str = "identity"
    dataset: str = ""
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()
    biases: tuple[float, ...] = ()
    sampling_temperature: float | None = None
    acceptance: tuple[float, ...] = ()

    def __post_init__(self):
        temps = tuple(float(t) for t in self.temperatures)
        if not temps or any(not math.isfinite(t) or t <= 0 for t in temps):
            raise ValueError(f"temperatures must be a non-empty sequence of finite values > 0, got {temps}")
        if self.objective not in OBJECTIVES + ("identity",):
            raise ValueError(f"objective must be one of {OBJECTIVES + ('identity',)}, got {self.objective!r}")
        for name in ("ece_before", "ece_after", "biases", "acceptance"):
            vals = tuple(float(v) for v in getattr(self, name))
            if vals and len(vals) != len(temps):
                raise ValueError(f"{name} must be empty or have γ={len(temps)} entries, got {len(vals)}")
            object.__setattr__(self, name, vals)
        if any(not math.isfinite(v) for v in self.biases):
            raise ValueError(f"biases must be finite, got {self.biases}")
        if any(not 0.0 <= v <= 1.0 for v in self.acceptance):
            raise ValueError(f"acceptance values must lie in [0, 1], got {self.acceptance}")
        t = self.sampling_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
            raise ValueError(f"sampling_temperature must be None or a finite float >= 0, got {t!r}")
        object.__setattr__(self, "sampling_temperature", None if t is None else float(t))
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

    @property
    def offsets(self) -> tuple[float, ...]:
        """b_k of every position (0 where the calibration has no biases)."""
        return self.biases or (0.0,) * self.gamma

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences σ(z_k / T_k + b_k).

        Shape: logits floating [..., γ] (γ must match) -> same dtype and shape.
        """
        if not torch.is_floating_point(logits) or logits.dim() < 1 or logits.shape[-1] != self.gamma:
            raise ValueError(f"logits must be floating [..., γ={self.gamma}], got {logits.dtype} "
                             f"{tuple(logits.shape)}")
        return self.apply_first(logits)

    def apply_first(self, logits: torch.Tensor) -> torch.Tensor:
        """σ(z_k / T_k + b_k) of the first k positions, for a block drafted only that far (k = 1 .. γ).

        Shape: logits floating [..., k] -> same dtype and shape.
        """
        if not torch.is_floating_point(logits) or logits.dim() < 1 or not 1 <= logits.shape[-1] <= self.gamma:
            raise ValueError(f"logits must be floating [..., k] with 1 <= k <= γ={self.gamma}, got {logits.dtype} "
                             f"{tuple(logits.shape)}")
        k = logits.shape[-1]
        temps = torch.tensor(self.temperatures[:k], dtype=logits.dtype, device=logits.device)
        if not self.biases:
            return torch.sigmoid(logits / temps)
        return torch.sigmoid(logits / temps + torch.tensor(self.biases[:k], dtype=logits.dtype, device=logits.device))

    def to_dict(self) -> dict:
        d = {"format": FORMAT, "temperatures": list(self.temperatures), "objective": self.objective,
             "dataset": self.dataset, "num_samples": self.num_samples,
             "ece_before": list(self.ece_before), "ece_after": list(self.ece_after)}
        if self.biases:
            d["biases"] = list(self.biases)
        if self.sampling_temperature is not None:
            d["sampling_temperature"] = self.sampling_temperature
        if self.acceptance:
            d["acceptance"] = list(self.acceptance)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> StsCalibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT or "temperatures" not in data:
            raise ValueError(f"not an STS calibration: expected format {FORMAT!r} with 'temperatures'")
        return cls(tuple(data["temperatures"]), data.get("objective", "identity"), data.get("dataset", ""),
                   int(data.get("num_samples", 0)), tuple(data.get("ece_before", ())),
                   tuple(data.get("ece_after", ())), tuple(data.get("biases", ())), data.get("sampling_temperature"),
                   tuple(data.get("acceptance", ())))

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
               num_bins: int = 20, biases: Sequence[float] | None = None) -> tuple[float, ...]:
    """Per-position ECE of the survival Π_{i<=k} σ(z_i / T_i + b_i) against 1[A > k] (spec §6 metric).

    Shapes: logits floating [N, γ]; num_accepted integer [N]; temperatures and biases (default 0) γ
    floats. Returns γ floats.
    """
    z, y = _check_data(logits, num_accepted)
    surv = torch.cumprod(torch.sigmoid(_calibrated_logits(z, temperatures, biases)), dim=1)
    return tuple(expected_calibration_error(surv[:, k], y[:, k], num_bins) for k in range(z.shape[1]))


def fit_sts(logits: torch.Tensor, num_accepted: torch.Tensor, objective: str = "nll", dataset: str = "",
            bounds: tuple[float, float] = (0.05, 20.0), num_bins: int = 20,
            sampling_temperature: float | None = None) -> StsCalibration:
    """Fit one temperature (and, under "affine", one bias) per draft position (module docstring).

    Parameters
    ----------
    logits : floating [N, γ]
        Raw confidence-head logits of verify-all rounds.
    num_accepted : integer [N] in [0, γ]
        Accepted drafts of each round.
    objective : "nll", "ece" or "affine"
    dataset : str, recorded in the result
    bounds : (lo, hi), search interval for T under "nll" (under "affine", T <= hi)
    num_bins : ECE bins (for "ece" and the reported before/after values)
    sampling_temperature : the temperature the rounds were recorded at, recorded in the result

    Returns
    -------
    StsCalibration
        A position no round reached (no data for its conditional) keeps T = 1 (and b = 0).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    lo, hi = (float(b) for b in bounds)
    if not 0 < lo < hi or not math.isfinite(hi):
        raise ValueError(f"bounds must satisfy 0 < lo < hi < inf, got {bounds}")
    z, y = _check_data(logits, num_accepted)
    gamma = z.shape[1]
    temps: list[float] = []
    biases: list[float] = []
    acceptance: list[float] = []
    for k in range(gamma):
        reached = y[:, k - 1] > 0 if k > 0 else torch.ones(z.shape[0], dtype=torch.bool)
        acceptance.append(float(y[reached, k].mean()) if reached.any() else 0.0)
        if objective == "nll":
            temps.append(_fit_nll(z[reached, k], y[reached, k], lo, hi))
        elif objective == "affine":
            t, b = _fit_affine(z[reached, k], y[reached, k], hi)
            temps.append(t)
            biases.append(b)
        else:
            temps.append(_fit_ece(z[:, :k + 1], y[:, k], temps, num_bins))
    return StsCalibration(tuple(temps), objective, dataset, z.shape[0],
                          prefix_ece(z, num_accepted, (1.0,) * gamma, num_bins),
                          prefix_ece(z, num_accepted, temps, num_bins, biases), tuple(biases), sampling_temperature,
                          tuple(acceptance))


def confidence_nll(logits: torch.Tensor, num_accepted: torch.Tensor, temperatures: Sequence[float],
                   biases: Sequence[float] | None = None) -> float:
    """Mean negative log-likelihood of the accepted counts under c_k = σ(z_k / T_k + b_k).

    -log P(A = a) = -Σ_{k<a} log c_k − log(1 − c_a) (last term absent when a = γ), averaged over rounds.
    Shapes: logits floating [N, γ]; num_accepted integer [N]; temperatures and biases (default 0) γ floats.
    """
    z, y = _check_data(logits, num_accepted)
    reached = torch.cat([torch.ones_like(y[:, :1]), y[:, :-1]], dim=1)  # [N, γ] position k was judged
    bce = F.binary_cross_entropy_with_logits(_calibrated_logits(z, temperatures, biases), y, reduction="none")
    return float((bce * reached).sum() / max(z.shape[0], 1))


def _calibrated_logits(z: torch.Tensor, temperatures: Sequence[float], biases: Sequence[float] | None) -> torch.Tensor:
    """z / T + b (float64 [N, γ]) for γ temperatures and γ biases (None: 0)."""
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float64)
    offsets = torch.tensor([float(b) for b in biases] if biases else [0.0] * temps.numel(), dtype=torch.float64)
    if temps.numel() != z.shape[1] or offsets.numel() != z.shape[1]:
        raise ValueError(f"got {temps.numel()} temperatures and {offsets.numel()} biases for γ={z.shape[1]}")
    return z / temps + offsets


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


def _fit_affine(z: torch.Tensor, y: torch.Tensor, hi: float, iterations: int = 100) -> tuple[float, float]:
    """argmin over (w = 1/T >= 1/hi, b) of Σ BCE(w·z + b, y): Newton's method on the convex 2-D
    logistic loss (a 1e-6 ridge keeps it finite when the data are separable); a solution with w below
    1/hi (a head that does not rank this position's outcomes) is refitted with w = 1/hi, b alone.

    Shapes: z, y float64 [M]. Returns (T, b); (1.0, 0.0) when M = 0.
    """
    if z.numel() == 0:
        return 1.0, 0.0
    x = torch.stack([z, torch.ones_like(z)], dim=1)  # [M, 2]
    theta = _newton_logistic(x, y, torch.tensor([1.0, 0.0], dtype=torch.float64), iterations)
    if theta[0] < 1.0 / hi:
        fixed = z / hi
        b = _newton_logistic(torch.ones_like(z)[:, None], y, torch.zeros(1, dtype=torch.float64), iterations,
                             fixed)[0]
        return hi, float(b)
    return 1.0 / float(theta[0]), float(theta[1])


def _newton_logistic(x: torch.Tensor, y: torch.Tensor, theta: torch.Tensor, iterations: int,
                     offset: torch.Tensor | None = None) -> torch.Tensor:
    """Minimise Σ BCE(x·θ + offset, y) + 1e-6/2 |θ|² by Newton steps, each halved until the loss
    drops (a full Newton step on a logistic loss can overshoot far from the optimum). x [M, P], y [M], θ [P]."""
    shift = offset if offset is not None else torch.zeros_like(y)
    ridge = 1e-6 * torch.eye(theta.numel(), dtype=torch.float64)

    def loss(th: torch.Tensor) -> float:
        return float(F.binary_cross_entropy_with_logits(x @ th + shift, y, reduction="sum") + 5e-7 * th.square().sum())

    current = loss(theta)
    for _ in range(iterations):
        p = torch.sigmoid(x @ theta + shift)
        grad = x.T @ (p - y) + 1e-6 * theta
        step = torch.linalg.solve((x.T * (p * (1 - p))) @ x + ridge, grad)
        scale = 1.0
        while scale > 1e-8 and loss(theta - scale * step) > current:
            scale /= 2
        theta = theta - scale * step
        current = loss(theta)
        if float((scale * step).abs().max()) < 1e-10:
            break
    return theta


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
