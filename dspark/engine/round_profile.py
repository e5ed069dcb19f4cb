"""Capacity from the engine's own rounds: `dspark profile --engine`.

    table = profile_rounds(model, drafter, RoundProfileConfig(requests=(1, 2, 4), context=128))

`dspark.profile` times bare target forwards (and a drafter's propose) on the dynamic path. Where the
engine runs something else, that is the wrong price: on CUDA a decode round replays captured graphs
(target verify, drafter propose and observe) with the next round in flight while the host commits,
and for a small model the eager forward's launch overhead is most of its time (dspark-tiny on one
H200: 16-18 ms per eager probe, a few ms per graph round). This module prices what the planner
chooses between by running it: for every load R and budget n, an `Engine` with `draft_tokens=n`
(n = 0: no drafter, the plain step) serves R requests of `context` random prompt tokens, and after
`warmup` decoding steps the wall time between consecutive `Engine.step()` returns is the round's
time: with a round in flight each call waits for the previous round only, so this is the pipelined
round a server sees, host bookkeeping included. Steps whose batch changed (a request reached EOS)
are dropped; the median of the rest is kept.

The table: SPS at B = R(1 + n) from the drafting budgets (two (R, n) pairs with the same B pool
their samples), and the plain curve SPS(R) from budget 0, which is what `planner.uniform_budget` and
`async_budget` read for "auto"'s plain rounds (a little low there: an "auto" plain round still
feeds the drafter's context).

`temperature` > 0 times sampled requests instead (seeded, one seed per request): the table of sampled
rounds (`EngineConfig.capacity_sampled`, shipped as a drafter's `capacity-<device>-sampled.json`). On
the static path they are a different round: synchronous, with the sampled propose and acceptance.

`auto_rounds` times each drafting budget n as "auto" runs it rather than as an engine at the fixed
budget n: an "auto" engine held at n by a step-shaped table (`forcing_table`: every budget up to
B = R(1 + n) at one speed, every larger one and plain decoding at almost none, so the planner's
argmax is K = R·n, or n per request in flight). The rounds then carry what "auto" pays and a fixed
budget does not: a synchronous round drafts the whole block (a fixed budget drafts n slots) and
spreads K by the current confidences (several verify groups when sampled), a round in flight drafts
a slot past n on its probe rounds.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from statistics import median

import torch

from dspark.engine.engine import Engine, EngineConfig
from dspark.profile import check_ints, device_name, increasing_ints
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable


@dataclass(frozen=True)
class RoundProfileConfig:
    """What to run.

    requests : loads R (strictly increasing, >= 1).
    budgets : fixed budgets n (strictly increasing, >= 0; 0 = plain decoding); None: 0 .. γ.
    context : prompt tokens of every request (>= 1).
    warmup, steps : untimed and timed decoding steps per (R, n) (steps >= 3).
    seed : of the random prompts (and of the sampled requests' generators).
    temperature : of every request; 0 (default) times greedy rounds, > 0 sampled ones.
    auto_rounds : time the drafting budgets as "auto" runs them (module docstring); the plain rounds
        stay a plain engine's.
    """

    requests: tuple[int, ...] = (1, 2, 4, 8)
    budgets: tuple[int, ...] | None = None
    context: int = 128
    warmup: int = 4
    steps: int = 24
    seed: int = 0
    temperature: float = 0.0
    auto_rounds: bool = False

    def __post_init__(self):
        object.__setattr__(self, "requests", increasing_ints("requests", self.requests, 1))
        if self.budgets is not None:
            object.__setattr__(self, "budgets", increasing_ints("budgets", self.budgets, 0))
        check_ints(self, context=1, warmup=0, steps=3, seed=0)
        SamplingParams(self.temperature)  # ValueError naming a bad temperature
        if not isinstance(self.auto_rounds, bool):
            raise ValueError(f"auto_rounds must be a bool, got {self.auto_rounds!r}")


def forcing_table(requests: int, budget: int) -> CapacityTable:
    """A table under which "auto" verifies K = requests · budget drafts a round (`async_budget`), or
    `budget` per request (`uniform_budget`), whenever every candidate's survival is positive: one speed
    up to B = requests · (1 + budget), almost none past it or for a plain step. Not a measurement."""
    b = requests * (1 + budget)
    return CapacityTable((b, b + 1), (1.0, 1e-9), f"forces K = {requests * budget} at R = {requests}",
                         plain_requests=(requests,), plain_steps_per_second=(1e-9,))


def round_seconds(model, drafter, requests: int, budget: int, config: RoundProfileConfig) -> list[float]:
    """Seconds of each timed decoding step of an engine at `budget` (held there as "auto" with
    `config.auto_rounds`) serving `requests` requests at `config.temperature` (steps whose batch
    changed dropped). Raises RuntimeError when fewer than half the steps are left."""
    auto = config.auto_rounds and budget > 0
    per_step = (drafter.block_size if auto else budget) + 1  # "auto" may give one request more than n
    max_new = (config.warmup + config.steps + 2) * per_step
    engine = Engine(model, EngineConfig(max_running=requests, max_waiting=requests, max_prompt_tokens=config.context,
                                        max_new_tokens=max_new, draft_tokens="auto" if auto else budget,
                                        drafter=drafter if budget else None,
                                        capacity=forcing_table(requests, budget) if auto else None))
    g = torch.Generator().manual_seed(config.seed)
    for i in range(requests):
        prompt = torch.randint(0, model.config.vocab_size, (config.context,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(config.temperature, seed=config.seed + i), max_new)
    while any(r.in_prefill for r in engine.running) or engine.waiting:
        engine.step()
    for _ in range(config.warmup):
        engine.step()
    seconds, last = [], time.perf_counter()
    for _ in range(config.steps):
        live = len(engine.running)
        events = engine.step()
        now = time.perf_counter()
        if live == requests and not any(e.finished for e in events):
            seconds.append(now - last)
        last = now
    for req in [*engine.running, *engine.waiting]:  # free the slots and state before the next engine is built
        engine.abort(req.request_id)
    if 2 * len(seconds) < config.steps:
        raise RuntimeError(f"R={requests} n={budget}: only {len(seconds)} of {config.steps} steps kept "
                           f"(requests finished early); raise the context or lower steps")
    return seconds


def profile_rounds(model, drafter, config: RoundProfileConfig = RoundProfileConfig(), model_name: str = "",
                   drafter_name: str = "", progress=None) -> CapacityTable:
    """The capacity table of this engine's rounds (module docstring). `drafter` is a resolved DSpark
    (or other) drafter with `block_size`; `progress(requests, budget, seconds)` after each pair."""
    budgets = config.budgets if config.budgets is not None else tuple(range(drafter.block_size + 1))
    if budgets[-1] > drafter.block_size:
        raise ValueError(f"budget {budgets[-1]} exceeds the drafter's block size γ={drafter.block_size}")
    if not any(budgets):
        raise ValueError(f"budgets {list(budgets)} hold no drafting budget (n >= 1)")
    samples: dict[int, list[float]] = {}
    plain: dict[int, list[float]] = {}
    for r in config.requests:
        for n in budgets:
            seconds = round_seconds(model, drafter, r, n, config)
            (plain.setdefault(r, []) if n == 0 else samples.setdefault(r * (1 + n), [])).extend(seconds)
            if progress is not None:
                progress(r, n, median(seconds))
    name = device_name(torch.device(model.device))
    kind = "greedy" if config.temperature == 0 else "sampled"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    conditions = {
        "device": name, "torch": torch.__version__, "model": model_name, "drafter": drafter_name,
        "dtype": str(model.dtype), "context": config.context, "requests": list(config.requests),
        "budgets": list(budgets), "warmup": config.warmup, "steps": config.steps, "date": date,
        "temperature": config.temperature, "rounds": "auto" if config.auto_rounds else "fixed",
        "method": f"median wall time between consecutive Engine.step() returns of an engine at a "
                  f"{'budget n held by auto' if config.auto_rounds else 'fixed budget n'} serving R {kind} requests "
                  f"(B = R(1 + n)); the plain curve from n = 0",
    }
    label = (f"{name}, torch {torch.__version__}, {model_name or type(model).__name__}, ctx {config.context}, "
             f"{'auto' if config.auto_rounds else 'engine'} rounds"
             + ("" if kind == "greedy" else f", T={config.temperature:g}"))
    return CapacityTable.from_step_times(samples, label, f"engine rounds, {date}", conditions, plain or None)
