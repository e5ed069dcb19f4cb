"""Greedy argmax over vocabulary rows: torch.argmax against `dspark.sampling.greedy`'s two passes.

    PYTHONPATH=. python bench/argmax_rows.py --out $OUT/argmax-rows-h200.json   # one H200, < 1 min
    PYTHONPATH=. python bench/argmax_rows.py --smoke --out /tmp/argmax.json      # CPU, checks only

Rows of V = 129280 fp32 logits (the V4 vocabulary), R ∈ {1, 4, 8, 64, 256} rows: the batch-1 decode
step, a DSpark verify block, the drafter's Markov chain (one row per request per slot) and batches.
Each row of the JSON: µs per call of each as a CUDA-graph replay with L2 flushed
(`bench.attn_batched.graph_timer`), and whether the indices are equal (random logits and small
integers with many ties).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dspark.sampling import greedy  # noqa: E402

VOCAB = 129280


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: equality only, no timing")
    cli = ap.parse_args()
    device = torch.device("cpu" if cli.smoke else "cuda")
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n_rows in (1, 4, 8, 64, 256):
        x = torch.randn(n_rows, VOCAB, generator=g, device=device)
        ties = torch.randint(-3, 4, (n_rows, VOCAB), generator=g, device=device).float()
        row = {"rows": n_rows, "vocab": VOCAB,
               "equal": bool(torch.equal(greedy(x), x.argmax(-1)) and torch.equal(greedy(ties), ties.argmax(-1)))}
        if not cli.smoke:
            from bench.attn_batched import graph_timer

            row["torch_us"] = graph_timer(lambda: x.argmax(-1)) * 1e6
            row["two_pass_us"] = graph_timer(lambda: greedy(x)) * 1e6
            row["speedup"] = row["torch_us"] / row["two_pass_us"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    conditions = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "dtype": "float32",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(cli.out, "w") as f:
        json.dump({"conditions": conditions, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
