"""The mHC site as ONE launch at decode sizes against the two-launch path, on one GPU: bitwise
repeatability over 300 eager calls (memory ordering of the atomic ticket), CUDA-graph replays with
changed inputs (the counter's reset), accuracy against the references, and µs per site in a graph of
12 × (pre, post_pre) at D 2048 / 4096, N 1..16; plus the zeroed counter's fill as a graph node.

Measures the one-launch site of commit 4bc4ef7, which was measured slower and reverted (be1a315);
run it on that commit's kernel:

    git show 4bc4ef7:dspark/kernels/mhc.py > dspark/kernels/mhc.py   # the reverted one-launch site
    PYTHONPATH=. python bench/mhc_decode_site.py $OUT/mhc-decode-site-h200.json
    git checkout dspark/kernels/mhc.py

One H200, 2026-11-30 (seventh session): `bench/results/mhc-decode-site-h200.json`.
"""
import json, sys, time
import torch
from dspark.kernels import mhc

torch.manual_seed(0)
dev = "cuda"
EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
results = {"check": [], "time": []}


def site(dim):
    return (torch.randn(24, 4 * dim, device=dev) * 0.05, torch.randn(24, device=dev) * 0.5, torch.rand(3, device=dev) + 0.5)


def inputs(n, dim, dtype=torch.bfloat16):
    x = torch.randn(n, 4, dim, device=dev).to(dtype)
    prev = mhc.mhc_pre_ref(torch.randn(n, 4, dim, device=dev).to(dtype), *site(dim), **EPS)
    f = torch.randn(n, dim, device=dev).to(dtype)
    return x, f, prev[0], prev[1]


def call(op, x, f, post, comb, params):
    if op == "pre":
        return mhc.mhc_pre(x, *params, **EPS)
    return mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)


def ref(op, x, f, post, comb, params):
    if op == "pre":
        return mhc.mhc_pre_ref(x, *params, **EPS)
    return mhc.mhc_post_pre_ref(f, x, post, comb, *params, **EPS)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


t0 = time.time()
for dtype in (torch.bfloat16, torch.float32):
    for op in ("pre", "post_pre"):
        for n, dim in ((1, 2048), (3, 2048), (8, 2048), (16, 2048), (1, 4096), (5, 7168), (16, 7168), (17, 2048)):
            params = site(dim)
            x, f, post, comb = inputs(n, dim, dtype)
            first = call(op, x, f, post, comb, params)
            err = max(rel(o, r) for o, r in zip(first, ref(op, x, f, post, comb, params)))
            eager_bad = sum(not same(call(op, x, f, post, comb, params), first) for _ in range(300))
            # graph: 20 calls captured, replayed with the captured inputs, then with new ones
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call(op, x, f, post, comb, params)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = [call(op, x, f, post, comb, params) for _ in range(20)]
            replay_bad = 0
            for r in range(30):
                if r % 2:
                    nx, nf, npost, ncomb = inputs(n, dim, dtype)
                    for a, b in ((x, nx), (f, nf), (post, npost), (comb, ncomb)):
                        a.copy_(b)
                want = call(op, x, f, post, comb, params)
                g.replay()
                torch.cuda.synchronize()
                replay_bad += sum(not same(o, want) for o in outs)
            del g, outs
            row = dict(dtype=str(dtype), op=op, n=n, dim=dim, rel_err=err, eager_mismatch_of_300=eager_bad,
                       replay_mismatch_of_600=replay_bad)
            results["check"].append(row)
            print(row, flush=True)
print("checks", time.time() - t0, "s", flush=True)


def step_time(n, dim, reps=200):
    """µs per site of a graph of 12 × (pre, post_pre), bf16."""
    params = [site(dim) for _ in range(24)]
    x, f, post, comb = inputs(n, dim)
    for i in range(2):
        call("pre", x, f, post, comb, params[0]); call("post_pre", x, f, post, comb, params[1])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(12):
            call("pre", x, f, post, comb, params[2 * i]); call("post_pre", x, f, post, comb, params[2 * i + 1])
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / 24


orig_tiles, orig_cap, orig_bound = mhc._stats_tiles, mhc._DECODE_SPLITS, mhc._DECODE_TOKENS
variants = {
    "two_launch": lambda: setattr(mhc, "_DECODE_TOKENS", 0),
    "one_launch": lambda: None,
    "one_launch_cap16": lambda: setattr(mhc, "_DECODE_SPLITS", 16),
    "one_launch_cap64": lambda: setattr(mhc, "_DECODE_SPLITS", 64),
    "one_launch_unfused8w": lambda: setattr(mhc, "_stats_tiles", lambda n, fused: (16, 64, 8) if n <= 256 else orig_tiles(n, fused)),
}
for dim in (2048, 4096):
    for n in (1, 2, 4, 8, 16):
        row = dict(n=n, dim=dim)
        for name, apply in variants.items():
            apply()
            try:
                row[name] = round(step_time(n, dim), 2)
            finally:
                mhc._stats_tiles, mhc._DECODE_SPLITS, mhc._DECODE_TOKENS = orig_tiles, orig_cap, orig_bound
        results["time"].append(row)
        print(row, flush=True)
# the counter's fill alone, as a graph node
z = torch.cuda.CUDAGraph()
with torch.cuda.graph(z):
    for _ in range(24):
        torch.zeros(1, device=dev, dtype=torch.int32)
z.replay(); torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(200):
    z.replay()
b.record(); torch.cuda.synchronize()
results["fill_us"] = a.elapsed_time(b) * 1e3 / 200 / 24
print("fill per node us", results["fill_us"])
json.dump(results, open(sys.argv[1], "w"), indent=1)
print("total", time.time() - t0, "s")
