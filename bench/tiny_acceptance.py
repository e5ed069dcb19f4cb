"""τ and position-wise acceptance of the embedded dspark-tiny pair, and its CPU wall-clock speedup.

    python bench/tiny_acceptance.py --out bench/results/tiny-acceptance-cpu.json

For temperature 0 and 1 and verification budgets 1..5 it decodes fixed code and prose prompts
(batched, 48 new tokens) with the shipped DSpark drafter, and once with plain decoding; the speedup
is the ratio of wall times within this one run (one torch thread).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

import dspark
from dspark.request import summed_counts

PROMPTS = {
    "code": ["def read_config(path):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n",
             "class Cache:\n    def __init__(self, size):\n", "    for key, value in items:\n        if "],
    "prose": ["ROMEO.\nBut soft, what light through yonder", "KING.\nNow, my good lords,",
              "Enter HAMLET.\n\nHAMLET.\n", "What say you to this, my lord?\n"],
}


def _run(model, prompts, **kw):
    t = time.perf_counter()
    outs = dspark.generate(model, prompts, max_new_tokens=48, seed=0, **kw)
    wall = time.perf_counter() - t
    rounds = sum(o.stats.rounds for o in outs)
    hist = summed_counts([o.stats.accept_hist for o in outs])
    pos = summed_counts([o.stats.position_accepts for o in outs])
    return {"tau": sum(o.stats.new_tokens - 1 for o in outs) / rounds, "rounds": rounds, "wall_s": wall,
            "accept_hist": hist, "position_accepts": pos}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/tiny-acceptance-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = dspark.load_model("tiny")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"conditions": {"machine": platform.processor() or platform.machine(), "threads": 1,
                             "torch": torch.__version__, "commit": commit, "max_new_tokens": 48,
                             "prompts_per_domain": 4, "batch": 4}, "runs": []}
    for temperature in (0.0, 1.0):
        for domain, prompts in PROMPTS.items():
            plain = _run(model, prompts, temperature=temperature)
            result["runs"].append({"domain": domain, "temperature": temperature, "budget": 0, **plain})
            for budget in range(1, 6):
                spec = _run(model, prompts, temperature=temperature, draft_tokens=budget)
                spec["speedup_vs_plain"] = plain["wall_s"] / spec["wall_s"]
                result["runs"].append({"domain": domain, "temperature": temperature, "budget": budget, **spec})
                print(f"T={temperature} {domain:5s} budget {budget}: tau {spec['tau']:.2f}, "
                      f"speedup {spec['speedup_vs_plain']:.2f}x", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
