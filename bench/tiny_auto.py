"""dspark-tiny: "auto" against every fixed budget, greedy and sampled (one CPU core by default, `--device`).

    python bench/tiny_auto.py --out bench/results/tiny_auto.json [--prompts 4] [--repeats 2]
        [--prompts-file tiny-data/v2/prompts.heldout.jsonl]

For each temperature and each budget (0 = plain, 1..γ, "auto"), one `Engine` per budget (built and
warmed up once per temperature, a whole batch at full length and every prompt's prefill, before any
timing, and reused: on CUDA its graph captures and Triton's compiles are not timed) decodes the first
`--prompts` HumanEval prompts of the shipped subset (or of a JSONL file of {"prompt": ...} records,
e.g. the held-out corpus cuts of `bench/tiny_drafter.py prompts`, every other one so both domains
come in) `--batch` at a time (default 1; prompt i of a batch sampled with seed + i as `generate`
does), `--max-new-tokens` each;
a cell's tokens/s is all its generated tokens over all its wall time, and its decode tokens/s those
of the steps that ran no prompt chunk over their wall time (the prefill, the same in every cell, dilutes
the first toward 1 in a ratio: dspark-tiny's eager prefill on a GPU is ~25 ms a step, a third of a
batch-4 cell). Cells are interleaved (repeat
r runs every cell once before repeat r + 1) so drift on a noisy machine hits every cell alike. τ is
committed tokens per request per round. The summary gives auto's
ratio to the best fixed budget (issue 7's target: >= 0.95 at every load) per temperature.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import dspark
from dspark.engine import Engine, EngineConfig
from dspark.evaluate import encode_prompt, load_prompts
from dspark.profile import device_name
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from provenance import git_commit


def _budget(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_engine(model, budget, batch: int, prompts, max_new_tokens: int, capacity=None,
                 trace: bool = False, temperatures=(0.0,), capacity_sampled=None) -> Engine:
    """One engine per budget, built once and reused by every repeat and temperature (as a server runs),
    warmed up per temperature by one whole batch at full length and by every prompt's prefill: on CUDA
    the sampled propose graphs are captured at a bucket's first sampled round, and Triton compiles a
    kernel again for each integer argument that turns divisible by 16 or equal to 1 as lengths grow (the
    eager prefill at every prompt length, decoding as positions grow); neither belongs in a timed cell
    (the twentieth session's GPU runs timed both: its first cells ran at a third of their speed)."""
    engine = Engine(model, EngineConfig(max_running=batch, max_waiting=batch,
                                        max_prompt_tokens=max(map(len, prompts)), max_new_tokens=max_new_tokens,
                                        draft_tokens=budget, capacity=capacity,
                                        capacity_sampled=capacity_sampled, trace=trace))
    for t in temperatures:
        serve(engine, prompts[:batch], t, 0, max_new_tokens)
        for i in range(batch, len(prompts), batch):
            serve(engine, prompts[i:i + batch], t, 0, 2)
    engine.take_trace()
    return engine


SERVED = ("tokens", "rounds", "decode_tokens", "decode_seconds")  # what `serve` sums


def _sums() -> dict:
    """A cell's running sums: `serve`'s, and the cell's wall seconds."""
    return dict.fromkeys(("seconds",) + SERVED, 0)


def serve(engine, prompts, temperature: float, seed: int, max_new_tokens: int) -> dict:
    """Decode `prompts` together to completion: tokens generated, rounds summed over requests, and the
    tokens and wall seconds of the steps that ran no prompt chunk ("decode_*")."""
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature, seed=seed + i), max_new_tokens)
    got = dict.fromkeys(SERVED, 0)
    while engine.has_work():
        prefilling = bool(engine.waiting) or any(r.in_prefill for r in engine.running)
        start = time.perf_counter()
        events = engine.step()
        seconds = time.perf_counter() - start
        tokens = sum(len(e.new_token_ids) for e in events)
        got["tokens"] += tokens
        got["rounds"] += sum(e.stats.rounds for e in events if e.finished)
        if not prefilling:
            got["decode_tokens"] += tokens
            got["decode_seconds"] += seconds
    return got


def run_cell(engine, prompts, temperature: float, seed: int, max_new_tokens: int, batch: int = 1) -> dict:
    """`serve` over `prompts`, `batch` at a time: its sums, and the cell's wall seconds."""
    cell = _sums()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for key, value in serve(engine, prompts[i:i + batch], temperature, seed + i, max_new_tokens).items():
            cell[key] += value
    cell["seconds"] = time.perf_counter() - start
    return cell


def _versus_best(rows: list[dict], temperature: float, metric: str, prefix: str) -> dict:
    """The best fixed budget at `temperature` by `metric`, and "auto"'s ratio to it (keys `prefix`ed)."""
    fixed = {r["draft_tokens"]: r[metric] for r in rows if r["temperature"] == temperature and r["draft_tokens"] != "auto"}
    best = max(fixed, key=fixed.get)
    auto = next((r[metric] for r in rows if r["temperature"] == temperature and r["draft_tokens"] == "auto"), None)
    return {f"{prefix}best_fixed": best, f"{prefix}best_fixed_tok_s": fixed[best], f"{prefix}auto_tok_s": auto,
            f"{prefix}auto_over_best": auto / fixed[best] if auto else None}


def run_parser(description: str, prompts: int, batch: int) -> argparse.ArgumentParser:
    """The options of a dspark-tiny engine bench (this one and `tiny_round_split.py`): output, prompts,
    batch, lengths, repeats, device, threads and the capacity table auto plans by."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--batch", type=int, default=batch, help="prompts decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the engine's graph path there")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--capacity", default=None, help="capacity table JSON for auto (default: the engine's)")
    return ap


def main() -> None:
    ap = run_parser(__doc__.split("\n")[0], prompts=4, batch=1)
    ap.add_argument("--budgets", default="0,1,2,3,4,5,auto")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-file", default=None, help="JSONL of {\"prompt\": text} (default: shipped humaneval)")
    ap.add_argument("--capacity-sampled", default=None,
                    help="capacity table JSON for auto's rounds with a sampled request (default: --capacity "
                         "when given, else the engine's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = dspark.load_model("tiny", device=args.device)
    if args.prompts_file:
        rows = [json.loads(line)["prompt"] for line in open(args.prompts_file) if line.strip()]
        texts, source = rows[::max(1, len(rows) // args.prompts)][:args.prompts], args.prompts_file
    else:
        texts, source = load_prompts("humaneval")[:args.prompts], "humaneval (shipped subset)"
    prompts = [encode_prompt(model, t) for t in texts]
    capacity = CapacityTable.load(args.capacity) if args.capacity else None
    sampled = CapacityTable.load(args.capacity_sampled) if args.capacity_sampled else None
    budgets = [_budget(b) for b in args.budgets.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    engines = {b: build_engine(model, b, args.batch, prompts, args.max_new_tokens, capacity, temperatures=temps,
                                 capacity_sampled=sampled) for b in budgets}
    cells = {(t, b): _sums() for t in temps for b in budgets}
    for r in range(args.repeats):
        for (t, b), acc in cells.items():
            got = run_cell(engines[b], prompts, t, args.seed + 1000 * r, args.max_new_tokens, args.batch)
            for k in acc:
                acc[k] += got[k]
    rows, summary = [], {}
    for (t, b), acc in cells.items():
        rows.append({"temperature": t, "draft_tokens": b, **acc, "tok_s": acc["tokens"] / acc["seconds"],
                     "decode_tok_s": acc["decode_tokens"] / acc["decode_seconds"],
                     "tau": acc["tokens"] / acc["rounds"]})
    for t in temps:
        summary[str(t)] = {**_versus_best(rows, t, "tok_s", ""), **_versus_best(rows, t, "decode_tok_s", "decode_")}
    result = {"bench": "tiny_auto", "conditions": {
        "device": device_name(model.device), "threads": args.threads,
        "torch": torch.__version__, "commit": git_commit(dirty=True), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": "tiny", "drafter": "dspark", "prompts": f"{source}: {len(prompts)} prompts", "batch": args.batch,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "capacity": capacity.label if capacity else "engine default",
        "capacity_sampled": sampled.label if sampled else "engine default"}, "cells": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"T={row['temperature']:g} n={row['draft_tokens']!s:>4}: {row['tok_s']:7.1f} tok/s  "
              f"decode {row['decode_tok_s']:7.1f} tok/s  tau {row['tau']:.2f}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
