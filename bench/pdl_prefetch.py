"""The weight prefetch before the PDL wait (`triton_compat.pdl_prefetch`), on and off, on a chain of
one-row GEMVs.

    PYTHONPATH=. python bench/pdl_prefetch.py --out $OUT/pdl-prefetch.json      # one H200, < 1 min

`LAYERS` v4-mini-sized layers of batch-1 decode GEMVs (wq_a-like [512, 2048], wo_b-like [2048, 2048]
and a compressor projection, 2 × [512, 2048]) with an RMSNorm between them, each op reading the
previous one's output. Every layer has its own weights (about 8 MB per layer, far beyond the 50 MB L2
over the chain), so each GEMV streams its weight from HBM as in a real step. The chain is captured
into one CUDA graph three ways: PDL with the prefetch, PDL without it, neither; the script reports the
median µs per chain of 20 replays, the achieved weight bandwidth, and whether the outputs are equal bit
for bit (the prefetch is a hint: it must not change a result).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.graph_timing import replay_seconds  # noqa: E402
from dspark.kernels import linear, rms_norm, triton_compat  # noqa: E402

LAYERS = 24
D, R, W = 2048, 512, 512


def chain():
    """(step, weight bytes per chain): step() runs the chain on fixed seeded inputs."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)

    x0, norm_w = rand(1, D), rand(D, dtype=torch.float32)
    layers = [(rand(R, D, scale=0.02), rand(D, D, scale=0.02), rand(W, D, scale=0.02), rand(W, D, scale=0.02),
               rand(4, W, dtype=torch.float32)) for _ in range(LAYERS)]
    phase, rows = torch.zeros(1, dtype=torch.long, device="cuda"), torch.tensor([3], device="cuda")
    kv_out, score_out = torch.empty(8, W, dtype=torch.bfloat16, device="cuda"), torch.empty(8, W, device="cuda")
    nbytes = sum(t.numel() * t.element_size() for layer in layers for t in layer[:4])

    def step():
        x, outs = x0, []
        for wq, wo, wkv, wgate, ape in layers:
            h = rms_norm.rms_norm(x, norm_w, eps=1e-6, out_dtype=torch.bfloat16)
            outs.append(linear.linear(h, wq))
            linear.compressor_project(h, wkv, wgate, ape, phase, kv_out=kv_out, score_out=score_out, out_rows=rows)
            x = linear.linear(h, wo)
        return [*outs, x, kv_out, score_out]

    return step, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/pdl-prefetch.json")
    args = ap.parse_args()
    variants = {"pdl+prefetch": (True, True), "pdl": (True, False), "neither": (False, False)}
    rows, results = [], {}
    for name in [*variants, *variants]:  # twice each, interleaved: drift shows as a spread
        triton_compat.PDL, triton_compat.PREFETCH = variants[name]  # this process only: the module switches
        step, nbytes = chain()
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        graph.replay()
        torch.cuda.synchronize()
        results.setdefault(name, [t.clone() for t in outs])
        us = replay_seconds(graph, 20) * 1e6
        rows.append({"variant": name, "us_per_chain": us, "us_per_layer": us / LAYERS,
                     "weight_gb_per_s": nbytes / us / 1e3})
        print(json.dumps(rows[-1]), flush=True)
    triton_compat.PDL, triton_compat.PREFETCH = True, True
    equal = all(torch.equal(a, b) for other in results.values() for a, b in zip(results["pdl+prefetch"], other))
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": __import__("triton").__version__, "layers": LAYERS, "weight_bytes": nbytes}
    print(json.dumps({"equal": equal}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows, "equal": equal}, indent=1) + "\n")


if __name__ == "__main__":
    main()
