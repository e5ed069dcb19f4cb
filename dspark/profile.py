"""`dspark profile`: measure SPS(B), target steps per second at B tokens per step, on this device.

The verify planner (`dspark.verify.planner`) reads SPS(B) from a `CapacityTable`; this measures one
for the loaded model where it runs. A probe at B batch tokens is one target forward over
R = ceil(B / width) requests that each verify `width` tokens (anchor + drafts; the last request
takes the remainder), every request already holding `context` tokens of state, which is what a
verify step at that load costs. The states are built once by prefilling random tokens and are
rewound to `context` after every probe (`DecodeState.truncate`), so every probe sees the same
context. Each probe is timed `repeats` times after `warmup` untimed runs, with the device
synchronised around each run; the table keeps the median.

Plain steps (`plain`, on by default): at every probe size R up to the number of states, one forward of
R requests feeding one token each, what a plain decoding round of R requests costs (the round in
flight's budget 0). A width-`width` probe at B = R spreads R tokens over R / width requests and so
underprices it; the table keeps these as its plain curve (`CapacityTable.plain`), which the planner
reads for budget 0.

Drafting (`drafter`, optional): a drafting round also runs the drafter, so with a drafter every width
probe adds the median time of one `propose` of a γ-block for its ceil(B / width) requests (greedy, each
drafter state holding the same `context` as the target's), and the plain curve stays drafter-free:
the table then prices a drafting round against a plain one, and the planners' budget 0 ("auto"'s plain
rounds) is chosen exactly where drafting does not pay. The drafter's `observe` of the committed rows
is not timed (a small part of a round next to the propose).

The table is labelled with the device and torch version and carries the model config, context,
width and date in `conditions`, so a table is never read as a measurement of something else.
"""

from __future__ import annotations

import datetime
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import torch

from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable


@dataclass(frozen=True)
class ProfileConfig:
    """What to probe.

    batch_tokens : probe sizes B, strictly increasing, each >= 1.
    context : tokens of state every request holds during a probe (>= 1).
    width : tokens each request verifies (1 + drafts), >= 1.
    warmup, repeats : untimed and timed runs per probe (repeats >= 1).
    prefill_chunk : tokens per prefill call while building the context.
    plain : also time plain steps (one token for each of R requests) at the probe sizes R up to
        ceil(max(batch_tokens) / width), the table's plain curve.
    """

    batch_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    context: int = 4096
    width: int = 4
    warmup: int = 2
    repeats: int = 5
    prefill_chunk: int = 4096
    plain: bool = True

    def __post_init__(self):
        object.__setattr__(self, "batch_tokens", increasing_ints("batch_tokens", self.batch_tokens, 1))
        check_ints(self, context=1, width=1, warmup=0, repeats=1, prefill_chunk=1)
        if not isinstance(self.plain, bool):
            raise ValueError(f"plain must be a bool, got {self.plain!r}")


def increasing_ints(name: str, values, low: int) -> tuple[int, ...]:
    """`values` as a non-empty, strictly increasing tuple of ints >= `low`; ValueError naming `name`."""
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values) \
            or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be strictly increasing ints >= {low}, got {list(values)}")
    return values


def check_ints(config, **lows: int) -> None:
    """ValueError unless each field `name` of `config` is an int >= lows[name]."""
    for name, low in lows.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def split_tokens(batch_tokens: int, width: int) -> list[int]:
    """Tokens per request of one probe: `width` each, the last request the remainder."""
    full, rest = divmod(batch_tokens, width)
    return [width] * full + ([rest] if rest else [])


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_states(model, requests: int, context: int, chunk: int, seed: int = 0, drafter=None) -> list:
    """`requests` fresh target states, each fed `context` random tokens (chunked, batched); with a
    drafter, returns (target states, drafter states), the drafter having observed every fed row."""
    g = torch.Generator().manual_seed(seed)
    states = [model.new_state() for _ in range(requests)]
    dstates = [drafter.new_state() for _ in range(requests)] if drafter is not None else None
    vocab = model.config.vocab_size
    capture = drafter.capture_layers if drafter is not None else ()
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        step = max(1, chunk // n)  # about `chunk` tokens per call
        for lo in range(0, requests, step):
            group = states[lo:lo + step]
            ids = torch.randint(0, vocab, (n * len(group),), generator=g).to(model.device)
            out = model(ids, group, [n] * len(group), capture_layers=capture)
            for j, dstate in enumerate(dstates[lo:lo + step] if dstates is not None else ()):
                rows = slice(j * n, (j + 1) * n)
                drafter.observe(dstate, ids[rows], out.hidden[rows], {i: f[rows] for i, f in out.features.items()})
    return (states, dstates) if drafter is not None else states


def time_propose(drafter, dstates: list, vocab: int, generator: torch.Generator, device: torch.device) -> float:
    """Seconds of one greedy `propose` of a γ-block for every state of `dstates` (states unchanged),
    from random anchors in [0, vocab)."""
    anchors = torch.randint(0, vocab, (len(dstates),), generator=generator).tolist()
    _sync(device)
    t = time.perf_counter()
    drafter.propose(dstates, anchors, SamplingParams(), [torch.Generator(device=device) for _ in dstates])
    _sync(device)
    return time.perf_counter() - t


def time_step(model, states: list, lens: Sequence[int], generator: torch.Generator, rewind: bool = True) -> float:
    """Seconds of one target forward feeding lens[b] random tokens to states[b], then rewinding
    (unless `rewind` is False: a V4.1 call long enough for bounded replay cannot be rewound)."""
    ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=generator).to(model.device)
    starts = [s.length for s in states]
    _sync(model.device)
    t = time.perf_counter()
    model(ids, states, list(lens))
    _sync(model.device)
    seconds = time.perf_counter() - t
    for state, start in zip(states, starts):
        if rewind:
            state.truncate(start)
    return seconds


@torch.inference_mode()
def profile_capacity(model, config: ProfileConfig = ProfileConfig(), model_name: str = "",
                     progress=None, drafter=None, drafter_name: str = "") -> CapacityTable:
    """Measure SPS at every `config.batch_tokens` probe; returns the labelled table. With `drafter`
    (a `Drafter`), each width probe's time includes one propose for its requests (module docstring).

    `progress(size, seconds, what)` (optional) is called after each probe: what "B" for a width
    probe of B batch tokens, "plain R" for a plain step of R requests, "propose R" for a drafter's
    propose for R requests.
    """
    device = torch.device(model.device)
    requests = math.ceil(config.batch_tokens[-1] / config.width)
    built = build_states(model, requests, config.context, config.prefill_chunk, drafter=drafter)
    states, dstates = built if drafter is not None else (built, None)
    g = torch.Generator().manual_seed(1)
    samples = {b: _probe(model, states, split_tokens(b, config.width), config, g, progress, b)
               for b in config.batch_tokens}
    if drafter is not None:
        vocab = model.config.vocab_size
        drafting = {r: median(_probe_propose(drafter, dstates[:r], vocab, config, g, device, progress))
                    for r in sorted({len(split_tokens(b, config.width)) for b in config.batch_tokens})}
        samples = {b: [t + drafting[len(split_tokens(b, config.width))] for t in ts] for b, ts in samples.items()}
    plain = {r: _probe(model, states, [1] * r, config, g, progress, r, "plain R")
             for r in config.batch_tokens if r <= requests} if config.plain else None
    name = device_name(device)
    conditions = {
        "device": name, "torch": torch.__version__, "model": model_name, "dtype": str(model.dtype),
        "model_config": model.config.to_dict() if hasattr(model.config, "to_dict") else repr(model.config),
        "context": config.context, "width": config.width, "warmup": config.warmup, "repeats": config.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "median of timed target forwards over ceil(B/width) requests with `context` tokens of state",
        "plain_method": "median of timed target forwards of one token for each of R requests" if plain else None,
        "draft_method": (f"{drafter_name or type(drafter).__name__}: the median of timed greedy propose calls of a "
                         f"γ={drafter.block_size} block for ceil(B/width) requests, added to every width probe; "
                         f"observe not timed") if drafter is not None else None,
    }
    label = f"{name}, torch {torch.__version__}, {model_name or type(model).__name__}, ctx {config.context}"
    if drafter is not None:
        label += f", drafting rounds ({drafter_name or type(drafter).__name__})"
    return CapacityTable.from_step_times(samples, label, f"width {config.width}, {conditions['date']}", conditions,
                                         plain)


def _probe(model, states: list, lens: list[int], config: ProfileConfig, generator, progress, size: int,
           what: str = "B") -> list[float]:
    """`config.repeats` timed forwards feeding lens[b] tokens to states[b] (after `warmup` untimed ones)."""
    for _ in range(config.warmup):
        time_step(model, states[:len(lens)], lens, generator)
    seconds = [time_step(model, states[:len(lens)], lens, generator) for _ in range(config.repeats)]
    if progress is not None:
        progress(size, min(seconds), what)
    return seconds


def _probe_propose(drafter, dstates: list, vocab: int, config: ProfileConfig, generator, device,
                   progress) -> list[float]:
    """`config.repeats` timed proposes for `dstates` (after `warmup` untimed ones)."""
    for _ in range(config.warmup):
        time_propose(drafter, dstates, vocab, generator, device)
    seconds = [time_propose(drafter, dstates, vocab, generator, device) for _ in range(config.repeats)]
    if progress is not None:
        progress(len(dstates), min(seconds), "propose R")
    return seconds
