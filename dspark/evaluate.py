"""`dspark eval-accept`: run evaluation prompts through the engine with tracing on, summarise τ.

Protocol (dspark spec §6): first user turn of each prompt, the tokenizer's chat template when it has
one (raw text otherwise), one request per prompt seeded `seed + i`, the whole drafted block verified
by default (budget "all": no confidence scheduling) so that the trace is also valid for calibration
and threshold sweeps. Outputs, in `out_dir`:

    traces.jsonl   one record per request per round (docs/traces.md), numbered by engine step
    summary.json   conditions, counts, τ and acceptance by position per domain and overall

Prompts come from the subsets shipped in `dspark/data/eval/` (20 per set, see its README) or from
`data_dir` (e.g. ../shared/data/eval for the full sets).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

import dspark
from dspark.analysis.acceptance import category_means, domain_table, summary_row
from dspark.analysis.traces import number_steps, write_traces
from dspark.draft import DRAFTER_NAMES, resolve_drafter
from dspark.engine import Engine, EngineConfig
from dspark.engine.engine import default_capacity
from dspark.sampling import SamplingParams
from dspark.tokenizer import prompt_codec
from dspark.verify.capacity import CapacityTable

FORMAT = "dspark-eval-accept/1"
DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench")
SHIPPED_DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "arena-hard-v2")
DEFAULT_SEED = 980406  # the DSpark evaluation seed (spec §6)


@dataclass(frozen=True)
class EvalConfig:
    """What one `eval_accept` run does; validated on construction.

    datasets : names of `<name>.jsonl` prompt files (DEFAULT_DATASETS)
    limit : first `limit` prompts of each set (None: all)
    temperature : target sampling temperature (spec §6: 1.0); 0 is greedy
    budget : "all" (verify the whole γ block), "auto" (confidence-scheduled planner) or an int n ≥ 0
    drafter : "ngram", "mtp" or "dspark"
    max_new_tokens, concurrency : per-request output cap; requests decoded together (engine max_running)
    seed : request i samples with seed + i
    planner : "sync" or "async" (used with budget "auto")
    data_dir : folder of prompt files; None for the shipped subsets
    """

    datasets: tuple[str, ...] = DEFAULT_DATASETS
    limit: int | None = None
    temperature: float = 1.0
    budget: int | str = "all"
    drafter: str = "ngram"
    max_new_tokens: int = 256
    concurrency: int = 1
    seed: int = DEFAULT_SEED
    planner: str = "sync"
    data_dir: str | None = None

    def __post_init__(self):
        if not self.datasets or any(not isinstance(d, str) or not d for d in self.datasets):
            raise ValueError(f"datasets must be non-empty names, got {self.datasets!r}")
        if len(set(self.datasets)) != len(self.datasets):
            raise ValueError(f"datasets lists a set twice: {self.datasets!r}")
        for name in ("max_new_tokens", "concurrency") + (("limit",) if self.limit is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.budget not in ("all", "auto") and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                                   or self.budget < 0):
            raise ValueError(f"budget must be 'all', 'auto' or an int >= 0, got {self.budget!r}")
        if self.drafter not in DRAFTER_NAMES:
            raise ValueError(f"drafter must be one of {DRAFTER_NAMES}, got {self.drafter!r}")


def parse_budget(text: str) -> int | str:
    """CLI form of `EvalConfig.budget`: "all", "auto", or a non-negative int."""
    if text in ("all", "auto"):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"budget must be 'all', 'auto' or an int, got {text!r}") from None


def load_prompts(dataset: str, data_dir: str | os.PathLike | None = None) -> list[str]:
    """First user turn of every prompt of `<dataset>.jsonl` (shipped subset unless `data_dir`)."""
    if data_dir is None:
        path = resources.files("dspark") / "data" / "eval" / f"{dataset}.jsonl"
        where = f"the shipped subsets {SHIPPED_DATASETS}"
    else:
        path = Path(data_dir) / f"{dataset}.jsonl"
        where = f"{data_dir} ({', '.join(sorted(p.stem for p in Path(data_dir).glob('*.jsonl')))})"
    if not path.is_file():
        raise ValueError(f"dataset {dataset!r} not found in {where}")
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line).get("turns")
        except (json.JSONDecodeError, AttributeError):
            turns = None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{path}:{lineno}: expected {{\"turns\": [str, ...]}}")
        prompts.append(turns[0])
    return prompts


def encode_prompt(model, text: str) -> list[int]:
    """Token ids of one user turn: the tokenizer's chat template (generation prompt appended) when
    it defines one, else the raw text."""
    tokenizer = getattr(model, "tokenizer", None)
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        # transformers 5 returns a BatchEncoding by default, 4.x a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    codec = prompt_codec(model)
    if codec is None:
        raise ValueError("the model has no tokenizer; text prompts cannot be encoded")
    return codec.encode(text)


def load_eval_model(name: str, device: str = "cpu"):
    """A checkpoint directory, or "random-tiny" (the random tiny V4 with a byte tokenizer)."""
    from dspark.cli import _load  # one definition of "random-tiny", shared with `dspark generate`

    return _load(name, device)


def run_traces(model, prompts: list[tuple[str, str, list[int]]], config: EvalConfig,
               capacity: CapacityTable | None = None, progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Decode `prompts` [(domain, request_id, token ids)] with tracing; returns (records, requests).

    `records` are the round traces numbered by engine step; `requests` one dict per prompt: request_id,
    domain, prompt_tokens, new_tokens, rounds, finish_reason.
    """
    from tqdm import tqdm  # a dependency; imported here to keep `import dspark.evaluate` light

    drafter = resolve_drafter(model, config.drafter) if config.budget != 0 else None
    draft_tokens = drafter.block_size if config.budget == "all" else config.budget
    engine = Engine(model, EngineConfig(
        max_running=config.concurrency, max_waiting=max(len(prompts), 1),
        max_prompt_tokens=max((len(p) for _, _, p in prompts), default=1), max_new_tokens=config.max_new_tokens,
        draft_tokens=draft_tokens, drafter=drafter, planner=config.planner, capacity=capacity, trace=True))
    for i, (domain, rid, ids) in enumerate(prompts):
        engine.add_request(ids, SamplingParams(temperature=float(config.temperature), seed=config.seed + i),
                           config.max_new_tokens, request_id=rid, domain=domain)
    done: dict[str, dict] = {}
    bar = tqdm(total=len(prompts), desc="eval-accept", unit="prompt", disable=not progress)
    while engine.has_work():
        for event in engine.step():
            if event.finished:
                s = event.stats
                done[event.request_id] = {"request_id": event.request_id, "prompt_tokens": s.prompt_tokens,
                                          "new_tokens": s.new_tokens, "rounds": s.rounds, "tau": s.tau,
                                          "finish_reason": event.finish_reason}
                bar.update(1)
    bar.close()
    requests = [{**done[rid], "domain": domain} for domain, rid, _ in prompts]
    return number_steps(engine.take_trace()), requests


def _json_safe(value):
    """NaN/inf become null so that summary.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def summarize(records: list[dict], requests: list[dict], conditions: dict) -> dict:
    """summary.json content: conditions, counts, overall and per-domain acceptance, category means."""
    finish: dict[str, int] = {}
    for r in requests:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    counts = {"prompts": len(requests), "rounds": len(records),
              "new_tokens": sum(r["new_tokens"] for r in requests), "finish_reasons": finish}
    summary = {"format": FORMAT, "conditions": conditions, "counts": counts}
    if records:
        domains = [d for d in dict.fromkeys(r["domain"] for r in requests)
                   if any(rec["domain"] == d for rec in records)]
        rows = domain_table(records, domains)
        summary.update(overall=summary_row(records), domains=rows, categories=category_means(rows))
    return _json_safe(summary)


def eval_accept(model, config: EvalConfig, out_dir: str | os.PathLike, model_name: str = "",
                capacity: CapacityTable | None = None, progress: bool = False) -> dict:
    """Run `config` on `model`, write traces.jsonl and summary.json under `out_dir`, return the summary.

    Prompts that cannot fit (prompt + max_new_tokens > the model's positions) are skipped and listed
    under counts.skipped.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = model.config.max_position_embeddings - config.max_new_tokens
    prompts, skipped = [], []
    for dataset in config.datasets:
        texts = load_prompts(dataset, config.data_dir)[:config.limit]
        for i, text in enumerate(texts):
            ids = encode_prompt(model, text)
            target = prompts if 0 < len(ids) <= limit else skipped
            target.append((dataset, f"{dataset}/{i}", ids))
    if capacity is None:  # what the engine would pick: the drafter's table for this device and kind of
        # request (every request samples at config.temperature), else the synthetic one
        drafter = resolve_drafter(model, config.drafter) if config.budget != 0 else None
        capacity = default_capacity(drafter, getattr(model, "device", "cpu"), sampled=config.temperature > 0)
    t0 = time.perf_counter()
    records, requests = run_traces(model, prompts, config, capacity, progress)
    wall = time.perf_counter() - t0
    write_traces(out / "traces.jsonl", records)
    tokenizer = getattr(model, "tokenizer", None)
    conditions = {
        **asdict(config), "datasets": list(config.datasets), "model": model_name,
        "gamma": max((len(r["draft"]) for r in records), default=None),  # plain rounds draft nothing
        "chat_template": bool(getattr(tokenizer, "chat_template", None)), "capacity": capacity.label,
        "dspark": dspark.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "device": str(getattr(model, "device", "cpu")), "wall_s": wall,
    }
    summary = summarize(records, requests, conditions)
    summary["counts"]["skipped"] = [{"request_id": rid, "prompt_tokens": len(ids)} for _, rid, ids in skipped]
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    return summary
