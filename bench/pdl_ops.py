"""Programmatic dependent launch (PDL) on the fused ops of one batch-1 decode step, on and off.

    PYTHONPATH=. python bench/pdl_ops.py --out $OUT/pdl-ops.json      # one H200, ~1 min

`decode_chain` is a v4-mini-sized (D 2048, 4 mHC copies, 32 heads of 512, 64 experts, top-6) run of
the decode ops that have PDL (linear / compressor not yet): mHC pre, RMSNorm, RoPE, the lightning
indexer, sparse attention, grouped wo_a, the fused MoE (decode router + decode experts), mHC post,
cache rounding; each op reads the previous one's output. `REPEATS` chains are captured into one CUDA
graph, once with `triton_compat.PDL` on and once off (the bench flips the module constant, as a test's
monkeypatch would), and the script reports the median µs per chain of 20 replays, the launches per
chain, and whether both graphs' outputs are equal bit for bit (tests/kernels/test_kernels_pdl.py
asserts the same).
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
from dspark.kernels import (attention, cache_round, grouped_wo_a, indexer, mhc, moe, rms_norm,  # noqa: E402
                            rope, triton_compat)

REPEATS = 16  # chains per graph: the replay's launch overhead is amortised over ~200 kernels


def decode_chain():
    """A function running the chain on fixed random inputs (seeded: two calls build equal inputs)
    and returning every output."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)

    eps = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    x = rand(1, 4, 2048)
    site = (rand(24, 8192, dtype=torch.float32, scale=0.02), rand(24, dtype=torch.float32),
            torch.rand(3, generator=g).cuda() + 0.5)
    norm_w, cos, sin = rand(2048, dtype=torch.float32), rand(1, 32, dtype=torch.float32), rand(1, 32, dtype=torch.float32)
    pool, index = rand(256, 512), torch.randint(-1, 256, (1, 128), generator=g).cuda()
    sink, keys, visible = rand(32, dtype=torch.float32), rand(512, 128), torch.tensor([512], device="cuda")
    wo_a = rand(4 * 512, 8 * 512, scale=0.02)  # G 4 groups of R 512, 8 heads of 512 per group
    router = (rand(64, 2048, scale=0.02), torch.zeros(64, device="cuda"))
    experts = [rand(*s, scale=0.02) for s in ((64, 256, 2048), (64, 2048, 256), (64, 256, 2048),
                                              (256, 2048), (2048, 256), (256, 2048))]

    def step():
        post, comb, u = mhc.mhc_pre(x, *site, **eps)
        h = rms_norm.rms_norm(u, norm_w, eps=1e-6, out_dtype=torch.bfloat16)
        q = rope.rope(h.view(1, 4, 512).repeat(1, 8, 1), cos[:, None], sin[:, None])  # [1, 32, 512]
        ids, _ = indexer.lightning_indexer(q[:, :, :128], h[:, :32].float(), keys, visible, None, topk=64)
        o = attention.sparse_attention(q, pool, index, sink, 512 ** -0.5)
        y = grouped_wo_a.grouped_wo_a(o, cos, sin, wo_a)  # [1, 2048]
        m = moe.fused_moe(y, *router, None, None, *experts, top_k=6, routed_scaling_factor=1.5, swiglu_limit=10.0,
                          hash_routing=False)
        x_new = mhc.mhc_post(m, x, post, comb)
        return post, comb, u, h, q, ids, o, y, m, x_new, cache_round.cache_round(o, fmt="fp8_ue8m0")

    return step


def capture(step, repeats: int):
    """step() once eagerly (compiles), then `repeats` chains captured into one graph: (graph, outputs
    of the last chain)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            outs = step()
    return graph, outs


def kernels_per_chain(step) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/pdl-ops.json")
    args = ap.parse_args()
    rows, results = [], {}
    for pdl in (False, True, False, True):  # twice each, interleaved: drift shows as a spread
        triton_compat.PDL = pdl  # the bench's own process: flips the one switch for every launch
        step = decode_chain()
        graph, outs = capture(step, REPEATS)
        graph.replay()
        torch.cuda.synchronize()
        results.setdefault(pdl, [t.clone() for t in outs])
        rows.append({"pdl": pdl, "pdl_launch_1": triton_compat.pdl_launch(torch.device("cuda"), 1),
                     "us_per_chain": replay_seconds(graph, 20) * 1e6 / REPEATS, "kernels_per_chain": kernels_per_chain(step)})
        print(json.dumps(rows[-1]), flush=True)
    triton_compat.PDL = True
    equal = all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": __import__("triton").__version__, "chains_per_graph": REPEATS}
    print(json.dumps({"equal_on_off": equal}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows, "equal_on_off": equal},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
