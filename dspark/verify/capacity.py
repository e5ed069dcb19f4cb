"""The engine's capacity curve SPS(B): target steps per second at a forward batch of B tokens.

The verify planner (`dspark.verify.planner`) trades expected accepted tokens against step time, so
it needs SPS at every batch-token count B = Σ_r (1 + ℓ_r) it may choose. A table is profiled per
deployment (GPU, parallelism, context length) by `dspark profile` (`dspark.profile`), stored as
JSON with the device label and the profiling conditions, and looked up here.

Between probes the *step time* 1/SPS is interpolated linearly: that is what an affine cost model
(fixed overhead + per-token cost) predicts between two measurements, and linear interpolation never
overshoots the probes, so a monotone table stays monotone. Below the first probe the first probe's
time is used (a smaller batch is assumed no faster, the conservative choice); above the last probe
the time grows in proportion to B (the compute-bound regime every GPU reaches eventually).

Lookups are O(1): the curve is tabulated once for every integer B up to the last probe.

What an entry prices. SPS(B) is one number per B, but a step of B tokens costs more when it spreads
over more requests (each reads its own context) and when it drafts too. The planners read B = R(1 + n)
for R requests verifying n drafts each, and the round in flight's plain rounds ("auto"'s budget 0,
`planner.uniform_budget(..., min_budget=0)`) read B = R as a plain step of R requests. A `dspark
profile` table times target forwards of B tokens in blocks of `width` rows (ceil(B / width) requests,
no drafter): exact for the budget width − 1 (width 4: budget 3), and no entry includes drafting. At
B = R it would be optimistic for a plain step (R / width requests' blocks, not R requests' single
rows), so `dspark profile` also times plain steps of R requests, one row each, and keeps them as the
table's second curve (`plain_requests`, `plain_steps_per_second`; `plain(R)`), which the planners read
for budget 0 wherever a table has it (tables without it price a plain step at B = R, as before).
`bench/engine_h200.py --table-from-cells` instead builds a table from the static engine's own
pipelined steps of one load: budgets 1..3 (propose, verify, observe) at B = R(1 + n), and B = R from
its plain-decoding cell ('none', which runs without a drafter, so without the observe a plain round
of the engine adds).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from statistics import median
from types import MappingProxyType

import numpy as np

FORMAT = "dspark-capacity/1"
_TABLES = resources.files("dspark.verify") / "tables"
_MAX_PROBE = 1 << 20  # batch-token probes beyond this are not a realistic verify batch


@dataclass(frozen=True)
class CapacityTable:
    """Profiled steps-per-second curve.

    Parameters
    ----------
    batch_tokens : sequence of int
        Probe batch sizes in tokens, strictly increasing, >= 1.
    steps_per_second : sequence of float
        Measured SPS at each probe, finite and > 0 (same length).
    label : str
        Where the numbers come from, e.g. "NVIDIA H200, TP1, ctx 4096" or "cpu-default (synthetic)".
    notes : str
        Free-form profiling conditions (commit, clocks, context length).
    conditions : mapping, optional
        Structured profiling conditions (device, torch version, model config, date, ...), kept
        through JSON as they are; not compared.
    plain_requests, plain_steps_per_second : sequences, optional
        A second curve: SPS of a plain step of R requests, one token each (budget 0), probed at
        these R; validated and interpolated as the main curve. Empty: `plain(R)` reads SPS(R).

    Raises
    ------
    ValueError
        On empty or mismatched sequences, non-increasing or non-positive batch sizes, or
        non-finite / non-positive speeds.
    """

    batch_tokens: tuple[int, ...]
    steps_per_second: tuple[float, ...]
    label: str
    notes: str = ""
    conditions: Mapping = field(default_factory=dict, compare=False)
    plain_requests: tuple[int, ...] = ()
    plain_steps_per_second: tuple[float, ...] = ()
    _dense: np.ndarray = field(init=False, repr=False, compare=False)  # [last probe + 1] SPS per B
    _plain_dense: np.ndarray | None = field(init=False, repr=False, compare=False)  # the same per R

    def __post_init__(self):
        bt, sps = _checked_curve(self.batch_tokens, self.steps_per_second, "batch_tokens", "steps_per_second")
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"label must be a non-empty string, got {self.label!r}")
        if not isinstance(self.conditions, Mapping):
            raise ValueError(f"conditions must be a mapping, got {type(self.conditions).__name__}")
        object.__setattr__(self, "conditions", MappingProxyType(dict(self.conditions)))
        object.__setattr__(self, "batch_tokens", bt)
        object.__setattr__(self, "steps_per_second", sps)
        object.__setattr__(self, "_dense", _dense_curve(bt, sps))
        plain = None
        if len(self.plain_requests) or len(self.plain_steps_per_second):
            pr, psps = _checked_curve(self.plain_requests, self.plain_steps_per_second, "plain_requests",
                                      "plain_steps_per_second")
            object.__setattr__(self, "plain_requests", pr)
            object.__setattr__(self, "plain_steps_per_second", psps)
            plain = _dense_curve(pr, psps)
        else:
            object.__setattr__(self, "plain_requests", ())
            object.__setattr__(self, "plain_steps_per_second", ())
        object.__setattr__(self, "_plain_dense", plain)

    def __call__(self, batch_tokens: int) -> float:
        """SPS at one batch size (int >= 1)."""
        b = int(batch_tokens)
        if b < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        return float(_lookup(self._dense, self.batch_tokens, self.steps_per_second, np.asarray([b]))[0])

    def many(self, batch_tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """Vectorised lookup: int array [N] (values >= 1) -> float64 SPS [N]."""
        b = np.asarray(batch_tokens, dtype=np.int64)
        if b.size and b.min() < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {int(b.min())}")
        return _lookup(self._dense, self.batch_tokens, self.steps_per_second, b)

    def plain(self, requests: int) -> float:
        """SPS of a plain step of `requests` requests (int >= 1), one token each: the plain curve where
        the table has one, else SPS(B = requests)."""
        r = int(requests)
        if r < 1:
            raise ValueError(f"requests must be >= 1, got {requests}")
        if self._plain_dense is None:
            return self(r)
        return float(_lookup(self._plain_dense, self.plain_requests, self.plain_steps_per_second, np.asarray([r]))[0])

    def step_time(self, batch_tokens: int) -> float:
        """Seconds per target step at `batch_tokens` (1 / SPS)."""
        return 1.0 / self(batch_tokens)

    def non_increasing(self) -> CapacityTable:
        """The curve when a batch may be padded up to any larger probe: SPS'(B) = max over B' >= B.

        Measured curves are jagged (tile and wave quantisation); an engine that pads to graph tiers
        gets the running maximum from the right, which is non-increasing in B.
        """
        def envelope(curve):
            return tuple(np.maximum.accumulate(np.asarray(curve)[::-1])[::-1].tolist()) if curve else ()

        return CapacityTable(self.batch_tokens, envelope(self.steps_per_second), self.label,
                             (self.notes + "; " if self.notes else "") + "non-increasing envelope", self.conditions,
                             self.plain_requests, envelope(self.plain_steps_per_second))

    @classmethod
    def from_step_times(cls, samples: dict[int, Sequence[float]], label: str, notes: str = "",
                        conditions: Mapping = MappingProxyType({}),
                        plain_samples: dict[int, Sequence[float]] | None = None) -> CapacityTable:
        """Build a table from repeated step-time measurements {batch_tokens: [seconds, ...]} (and
        optionally plain steps' {requests: [seconds, ...]}, the plain curve).

        Each probe is reduced to the median time (robust to stragglers), then inverted.
        """
        if not samples:
            raise ValueError("samples must hold at least one probe")
        bt, sps = _speeds(samples, "batch_tokens")
        pr, psps = _speeds(plain_samples, "requests") if plain_samples else ((), ())
        return cls(bt, sps, label, notes, conditions, pr, psps)

    def to_dict(self) -> dict:
        d = {"format": FORMAT, "label": self.label, "notes": self.notes, "conditions": dict(self.conditions),
             "batch_tokens": list(self.batch_tokens), "steps_per_second": list(self.steps_per_second)}
        if self.plain_requests:
            d.update(plain_requests=list(self.plain_requests), plain_steps_per_second=list(self.plain_steps_per_second))
        return d

    @classmethod
    def from_dict(cls, data: dict) -> CapacityTable:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a capacity table: expected format {FORMAT!r}, got "
                             f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
        missing = [k for k in ("label", "batch_tokens", "steps_per_second") if k not in data]
        if missing:
            raise ValueError(f"capacity table is missing {missing}")
        return cls(tuple(data["batch_tokens"]), tuple(data["steps_per_second"]), data["label"],
                   data.get("notes", ""), data.get("conditions", {}), tuple(data.get("plain_requests", ())),
                   tuple(data.get("plain_steps_per_second", ())))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> CapacityTable:
        """A table from a JSON file, or one of the shipped tables by name (`shipped_tables()`)."""
        if isinstance(path, str) and path in shipped_tables():
            return cls.from_dict(json.loads(_TABLES.joinpath(f"{path}.json").read_text()))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"capacity table {str(path)!r}: no such file, and not a shipped table "
                                    f"({', '.join(shipped_tables())})")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _checked_curve(points, speeds, points_name: str, speeds_name: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(points, speeds) as int / float tuples: non-empty, equal lengths, points strictly increasing
    in [1, _MAX_PROBE], speeds finite and > 0; ValueError naming the bad value."""
    bt, sps = list(points), list(speeds)
    if not bt or len(bt) != len(sps):
        raise ValueError(f"{points_name} ({len(bt)}) and {speeds_name} ({len(sps)}) must be "
                         f"non-empty and of equal length")
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in bt):
        raise ValueError(f"{points_name} must be ints, got {bt}")
    if bt[0] < 1 or bt[-1] > _MAX_PROBE:
        raise ValueError(f"{points_name} must lie in [1, {_MAX_PROBE}], got {bt[0]}..{bt[-1]}")
    for i in range(1, len(bt)):
        if bt[i] <= bt[i - 1]:
            raise ValueError(f"{points_name} must be strictly increasing; {bt[i]} follows {bt[i - 1]}")
    for b, s in zip(bt, sps):
        if isinstance(s, bool) or not isinstance(s, (int, float, np.floating, np.integer)) \
                or not math.isfinite(s) or s <= 0:
            raise ValueError(f"{speeds_name} must be finite and > 0; got {s!r} at {points_name}={b}")
    return tuple(int(b) for b in bt), tuple(float(s) for s in sps)


def _dense_curve(points: tuple[int, ...], speeds: tuple[float, ...]) -> np.ndarray:
    """SPS at every integer from 0 to the last probe, step times interpolated linearly (read-only)."""
    grid = np.arange(points[-1] + 1, dtype=np.float64)
    dense = 1.0 / np.interp(grid, np.asarray(points, np.float64), 1.0 / np.asarray(speeds, np.float64))
    dense.setflags(write=False)
    return dense


def _lookup(dense: np.ndarray, points: tuple[int, ...], speeds: tuple[float, ...], b: np.ndarray) -> np.ndarray:
    """SPS at int array b (>= 1): the dense curve up to the last probe, time ∝ b beyond it."""
    last = points[-1]
    return np.where(b <= last, dense[np.minimum(b, last)], speeds[-1] * last / np.maximum(b, 1))


def _speeds(samples: dict[int, Sequence[float]], what: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(sorted probes, 1 / median step time of each) of {probe: [seconds, ...]}."""
    points = sorted(samples)
    times = []
    for b in points:
        ts = list(samples[b])
        if not ts or any(not math.isfinite(t) or t <= 0 for t in ts):
            raise ValueError(f"step times at {what}={b} must be non-empty, finite and > 0")
        times.append(median(ts))
    return tuple(points), tuple(1.0 / t for t in times)


def shipped_tables() -> tuple[str, ...]:
    """Names of the measured tables shipped with dspark (dspark/verify/tables/*.json), each labelled
    with the GPU, model and context it was profiled on."""
    return tuple(sorted(p.name[:-5] for p in _TABLES.iterdir() if p.name.endswith(".json")))


def default_cpu_table() -> CapacityTable:
    """A synthetic table for CPU runs and tests, labelled as such: not a measurement.

    Affine cost model: 20 ms per step plus 0.5 ms per batch token, probed at powers of two up to
    1024 tokens. Use a profiled table for any throughput claim.
    """
    bt = tuple(2**i for i in range(11))
    return CapacityTable(bt, tuple(1.0 / (0.020 + 0.0005 * b) for b in bt),
                         "cpu-default (synthetic affine model, not profiled)",
                         "step time = 20 ms + 0.5 ms x batch tokens")
