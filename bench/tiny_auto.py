"""dspark-tiny: "auto" against every fixed budget, greedy and sampled (one CPU core by default, `--device`).

    python bench/tiny_auto.py --out bench/results/tiny_auto.json [--prompts 4] [--repeats 2]
        [--prompts-file tiny-data/v2/prompts.heldout.jsonl]

For each temperature and each budget (0 = plain, 1..γ, "auto"), `dspark.generate` decodes the first
`--prompts` HumanEval prompts of the shipped subset (or of a JSONL file of {"prompt": ...} records,
e.g. the held-out corpus cuts of `bench/tiny_drafter.py prompts`, every other one so both domains
come in) `--batch` at a time (default 1), `--max-new-tokens` each;
a cell's tokens/s is all its generated tokens over all its wall time (τ: per request and round). Cells are interleaved (repeat
r runs every cell once before repeat r + 1) so drift on a noisy machine hits every cell alike, and one
untimed warm-up generate precedes the timing. τ is committed tokens per round. The summary gives auto's
ratio to the best fixed budget (issue 7's target: >= 0.95 at every load) per temperature.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

import dspark
from dspark.evaluate import encode_prompt, load_prompts
from dspark.verify.capacity import CapacityTable

REPO = Path(__file__).resolve().parents[1]


def _commit() -> str:
    """HEAD's short hash, with "+dirty" when a tracked file differs from it (what actually ran; untracked
    files such as fresh results do not count)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _budget(text: str) -> int | str:
    return text if text == "auto" else int(text)


def run_cell(model, prompts, budget, temperature: float, seed: int, max_new_tokens: int, capacity=None,
             batch: int = 1) -> dict:
    tokens = rounds = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = dspark.generate(model, prompts[i:i + batch], max_new_tokens=max_new_tokens, temperature=temperature,
                               seed=seed + i, draft_tokens=budget, capacity=capacity)
        tokens += sum(len(o.token_ids) for o in outs)
        rounds += sum(o.stats.rounds for o in outs)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budgets", default="0,1,2,3,4,5,auto")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the engine's graph path there")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together (one generate call)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-file", default=None, help="JSONL of {\"prompt\": text} (default: shipped humaneval)")
    ap.add_argument("--capacity", default=None, help="capacity table JSON for auto (default: the engine's)")
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
    budgets = [_budget(b) for b in args.budgets.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    dspark.generate(model, prompts[0], max_new_tokens=16, draft_tokens=1)  # warm-up
    cells = {(t, b): {"seconds": 0.0, "tokens": 0, "rounds": 0} for t in temps for b in budgets}
    for r in range(args.repeats):
        for (t, b), acc in cells.items():
            got = run_cell(model, prompts, b, t, args.seed + 1000 * r, args.max_new_tokens, capacity, args.batch)
            for k in acc:
                acc[k] += got[k]
    rows, summary = [], {}
    for (t, b), acc in cells.items():
        rows.append({"temperature": t, "draft_tokens": b, **acc, "tok_s": acc["tokens"] / acc["seconds"],
                     "tau": acc["tokens"] / acc["rounds"]})
    for t in temps:
        fixed = {r["draft_tokens"]: r["tok_s"] for r in rows if r["temperature"] == t and r["draft_tokens"] != "auto"}
        best = max(fixed, key=fixed.get)
        auto = next((r["tok_s"] for r in rows if r["temperature"] == t and r["draft_tokens"] == "auto"), None)
        summary[str(t)] = {"best_fixed": best, "best_fixed_tok_s": fixed[best],
                           "auto_tok_s": auto, "auto_over_best": auto / fixed[best] if auto else None}
    result = {"bench": "tiny_auto", "conditions": {
        "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else f"cpu ({platform.processor() or platform.machine()})"), "threads": args.threads,
        "torch": torch.__version__, "commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": "tiny", "drafter": "dspark", "prompts": f"{source}: {len(prompts)} prompts", "batch": args.batch,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "capacity": capacity.label if capacity else "engine default"}, "cells": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"T={row['temperature']:g} n={row['draft_tokens']!s:>4}: {row['tok_s']:7.1f} tok/s  tau {row['tau']:.2f}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
