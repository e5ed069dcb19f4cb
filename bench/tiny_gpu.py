"""dspark-tiny at batch 1 on a GPU: plain vs speculative wall clock in one run.

    python bench/tiny_gpu.py --out $OUT/tiny-gpu.json

Loads the embedded pair on CUDA in fp32 (so the tokens equal the CPU reference), warms up, then for
each prompt decodes 128 tokens greedily with draft_tokens 0, 3, 5 and "auto", and reports tokens/s
and the speedup over plain decoding. The reference path runs (no fused kernels, no CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dspark

PROMPTS = ["def read_config(path):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n",
           "ROMEO.\nBut soft, what light through yonder", "KING.\nNow, my good lords,"]


def _time(model, prompt, budget):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = dspark.generate(model, prompt, max_new_tokens=128, draft_tokens=budget)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/tiny-gpu.json")
    args = ap.parse_args()
    model = dspark.load_model("tiny", device="cuda", dtype=torch.float32)
    _time(model, PROMPTS[0], 0), _time(model, PROMPTS[0], 5)  # warm-up
    rows = []
    for prompt in PROMPTS:
        base, ref = _time(model, prompt, 0)
        for budget in (0, 3, 5, "auto"):
            wall, out = _time(model, prompt, budget) if budget != 0 else (base, ref)
            rows.append({"prompt": prompt[:24], "budget": budget, "wall_s": wall, "tau": out.stats.tau,
                         "tok_s": out.stats.new_tokens / wall, "speedup": base / wall,
                         "same_tokens": out.token_ids == ref.token_ids})
            print(rows[-1], flush=True)
    result = {"conditions": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": 1,
                             "max_new_tokens": 128, "dtype": "float32", "kernels": str(model.kernels), "graphs": False},
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
