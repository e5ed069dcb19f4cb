"""Whole-model prefill with the W8A8 experts against the shipped kernels, v4-mini on one GPU.

Two v4-mini models with the same random bf16 weights (seed 0): `KernelConfig.for_device("cuda")` and
the same with ``moe_experts="w8a8"`` (every MoE layer's experts quantised once to FP8 128×128, x and h
per token per 128 columns). Each forward feeds N random tokens to a fresh state (`profile.time_step`,
rewound after); rounds alternate the two models; the median of `--repeats` forwards per round is
kept. The last round's final-token logits of the two models are compared (‖Δ‖/‖ref‖, argmax equal).

    python bench/prefill_w8a8.py --tokens 4096,8192 --out bench/results/prefill-w8a8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

from kernels import conditions  # noqa: E402 (bench/ is on sys.path)
from provenance import git_commit  # noqa: E402


def main(argv=None) -> int:
    import dspark
    from dspark.configs import load_config
    from dspark.kernels import KernelConfig
    from dspark.profile import time_step

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/prefill-w8a8.json")
    args = p.parse_args(argv)
    shipped = KernelConfig.for_device("cuda")
    configs = {"shipped": shipped, "w8a8": dataclasses.replace(shipped, moe_experts="w8a8")}
    config = load_config("v4-mini")
    models = {name: dspark.init_model(config, seed=0, device="cuda", dtype=torch.bfloat16, kernels=kernels)
              for name, kernels in configs.items()}
    result = {"conditions": {**conditions(git_commit(dirty=True)), "config": "v4-mini",
                             "kernels": {name: str(k) for name, k in configs.items()}}, "rows": []}
    print(json.dumps(result["conditions"]))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for model in models.values():  # compile and convert once, outside the timed forwards
            time_step(model, [model.new_state()], [1024], g)
        for n in [int(t) for t in args.tokens.split(",")]:
            for rnd in range(1, args.rounds + 1):
                for name, model in models.items():
                    times = [time_step(model, [model.new_state()], [n], g) for _ in range(args.repeats)]
                    row = {"model": name, "new_tokens": n, "round": rnd, "seconds": statistics.median(times),
                           "tok_s": n / statistics.median(times), "all_s": times}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
        ids = torch.randint(0, config["vocab_size"], (4096,), generator=g).cuda()
        logits = {name: model(ids, [model.new_state()], [4096]).logits[-1] for name, model in models.items()}
    ref, w8a8 = logits["shipped"], logits["w8a8"]
    result["last_logits"] = {"rel_err": ((w8a8 - ref).norm() / ref.norm()).item(),
                             "argmax_equal": bool(ref.argmax() == w8a8.argmax())}
    speed = {(r["model"], r["new_tokens"]): [] for r in result["rows"]}
    for r in result["rows"]:
        speed[(r["model"], r["new_tokens"])].append(r["tok_s"])
    result["ratio_w8a8_over_shipped"] = {
        str(n): [w / s for w, s in zip(speed[("w8a8", n)], speed[("shipped", n)])] for (_, n) in speed}
    print(json.dumps({k: result[k] for k in ("last_logits", "ratio_w8a8_over_shipped")}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
