"""A/B of the V4 mHC site with the sublayer RMSNorm folded in (`mhc_norm.py`) against the unfused pair
(`mhc_pre` / `mhc_post_pre`, then `rms_norm`), at decode sizes on one GPU.

Per (N, D), bf16: accuracy of both against the references, whether the fused h equals the pair's
bit for bit (and the largest difference where not), then µs per site of a CUDA graph of 12 × (pre,
post_pre) sites = 24 sites, each followed by its norm (the unfused pair: 48 launches + 24 norms;
fused: 48 launches), median of replays. Also the epilogue's tile variants (`--tiles`).

    PYTHONPATH=. python bench/mhc_norm_site.py --out $OUT/mhc-norm-site-h200.json

(`bench/mhc_decode_site.py` times the reverted one-launch site and runs only on that commit.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import capture, replay_seconds  # noqa: E402

from dspark.kernels import mhc, mhc_norm, rms_norm  # noqa: E402

EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
NORM_EPS = 1e-6


def site(dim: int, g: torch.Generator):
    """One site's (fn, base, scale, norm weight) on the GPU."""
    return [t.cuda() for t in (torch.randn(24, 4 * dim, generator=g) * 0.05, torch.randn(24, generator=g) * 0.5,
                               torch.rand(3, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5)]


def unfused_pre(x, fn, base, scale, w):
    post, comb, u = mhc.mhc_pre(x, fn, base, scale, **EPS)
    return post, comb, rms_norm.rms_norm(u, w, eps=NORM_EPS, out_dtype=u.dtype)


def unfused_post_pre(f, x, post, comb, fn, base, scale, w):
    x_new, post2, comb2, u = mhc.mhc_post_pre(f, x, post, comb, fn, base, scale, **EPS)
    return x_new, post2, comb2, rms_norm.rms_norm(u, w, eps=NORM_EPS, out_dtype=u.dtype)


def fused_pre(x, fn, base, scale, w):
    return mhc_norm.mhc_pre_norm(x, fn, base, scale, w, **EPS, norm_eps=NORM_EPS)


def fused_post_pre(f, x, post, comb, fn, base, scale, w):
    return mhc_norm.mhc_post_pre_norm(f, x, post, comb, fn, base, scale, w, **EPS, norm_eps=NORM_EPS)


PATHS = {"unfused": (unfused_pre, unfused_post_pre), "fused": (fused_pre, fused_post_pre)}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(n: int, dim: int, g: torch.Generator) -> dict:
    x = torch.randn(n, 4, dim, generator=g).cuda().bfloat16()
    f = torch.randn(n, dim, generator=g).cuda().bfloat16()
    params = site(dim, g)
    post, comb, _ = mhc.mhc_pre_ref(x, *params[:3], **EPS)
    row = dict(n=n, dim=dim)
    for name, args, ref in (("pre", (x, *params), mhc_norm.mhc_pre_norm_ref(x, *params, **EPS, norm_eps=NORM_EPS)),
                            ("post_pre", (f, x, post, comb, *params),
                             mhc_norm.mhc_post_pre_norm_ref(f, x, post, comb, *params, **EPS, norm_eps=NORM_EPS))):
        i = 0 if name == "pre" else 1
        fused, unfused = PATHS["fused"][i](*args), PATHS["unfused"][i](*args)
        h, h_pair = fused[-1], unfused[-1]
        row[name] = dict(rel_err_fused=max(rel(o, r) for o, r in zip(fused, ref)),
                         rel_err_unfused=max(rel(o, r) for o, r in zip(unfused, ref)),
                         h_equal=torch.equal(h, h_pair), h_differing=int((h != h_pair).sum()),
                         h_max_rel=((h.double() - h_pair.double()).abs() / h_pair.double().abs().clamp_min(1e-30))
                         .max().item(),
                         mixes_equal=all(torch.equal(a, b) for a, b in zip(fused[:-1], unfused[:-1])))
    return row


def site_us(path: str, n: int, dim: int, g: torch.Generator, reps: int) -> float:
    """µs per site: a graph of 12 × (pre, post_pre) with their norms, bf16, distinct parameters."""
    pre, post_pre = PATHS[path]
    params = [site(dim, g) for _ in range(24)]
    x = torch.randn(n, 4, dim, generator=g).cuda().bfloat16()
    f = torch.randn(n, dim, generator=g).cuda().bfloat16()
    post, comb, _ = mhc.mhc_pre_ref(x, *params[0][:3], **EPS)

    def step():
        for i in range(12):
            pre(x, *params[2 * i])
            post_pre(f, x, post, comb, *params[2 * i + 1])

    return replay_seconds(capture(step), reps) * 1e6 / 24


def stats_variant_us(spec: str, n: int, dim: int, g: torch.Generator, reps: int) -> float:
    """`site_us` of the fused path with the statistics tiles of `spec` (PRE/POST[/SPLIT]: warps of the
    pre and post_pre sites up to 8 tokens, and the split-streams threshold), this process only."""
    pre_w, post_w, *split = (int(v) for v in spec.split("/"))
    saved = mhc._stats_tiles, mhc.SPLIT_STREAMS_MAX_TOKENS
    mhc._stats_tiles = lambda n_tok, fused: ((16, 64, post_w if fused else pre_w) if n_tok <= 8
                                             else saved[0](n_tok, fused))
    mhc.SPLIT_STREAMS_MAX_TOKENS = split[0] if split else saved[1]
    try:
        return site_us("fused", n, dim, g, reps)
    finally:
        mhc._stats_tiles, mhc.SPLIT_STREAMS_MAX_TOKENS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mhc-norm-site.json"))
    ap.add_argument("--tokens", default="1,8", help="comma list of N")
    ap.add_argument("--dims", default="2048,4096", help="comma list of D")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tiles", default="1x512,1x1024,4x256",
                    help="epilogue (BLOCK_T x BLOCK_D) variants of the fused path, timed besides the default")
    ap.add_argument("--split-streams", default="",
                    help="comma list of mhc.SPLIT_STREAMS_MAX_TOKENS values to time both paths at besides the "
                         "shipped one (0: the statistics pass never splits the streams)")
    ap.add_argument("--stats-warps", default="",
                    help="comma list of PRE/POST[/SPLIT] variants of the statistics tiles up to 8 tokens, timed on "
                         "the fused path: the warps of the pre and post_pre sites' 16 x 64 tiles and optionally "
                         "mhc.SPLIT_STREAMS_MAX_TOKENS (shipped: 4/8 and 4)")
    ap.add_argument("--sinkhorn-iters", type=int, default=EPS["sinkhorn_iters"],
                    help="Sinkhorn iterations of every site (V4: 20); fewer prices the Sinkhorn's share of a site")
    cli = ap.parse_args()
    if cli.sinkhorn_iters < 1:
        raise ValueError(f"--sinkhorn-iters must be >= 1, got {cli.sinkhorn_iters}")
    EPS["sinkhorn_iters"] = cli.sinkhorn_iters  # this process only
    g = torch.Generator().manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {"conditions": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
                              "dtype": "bfloat16", "sites_per_graph": 24, "reps": cli.reps,
                              "sinkhorn_iters": cli.sinkhorn_iters}, "check": [], "time": []}
    tokens = [int(t) for t in cli.tokens.split(",")]
    dims = [int(d) for d in cli.dims.split(",")]
    for n in tokens:
        for dim in dims:
            row = check(n, dim, g)
            results["check"].append(row)
            print(json.dumps(row), flush=True)
    default_tiles = mhc_norm._norm_tiles
    mhc_norm.FOLD_MAX_TOKENS = 1 << 30  # this process only: time the fused epilogue at every N
    for n in tokens:
        for dim in dims:
            row = dict(n=n, dim=dim, **{f"{p}_us": round(site_us(p, n, dim, g, cli.reps), 2) for p in PATHS})
            shipped = mhc.SPLIT_STREAMS_MAX_TOKENS
            for value in (int(v) for v in cli.split_streams.split(",") if v):
                mhc.SPLIT_STREAMS_MAX_TOKENS = value  # this process only
                try:
                    row.update({f"{p}_split{value}_us": round(site_us(p, n, dim, g, cli.reps), 2) for p in PATHS})
                finally:
                    mhc.SPLIT_STREAMS_MAX_TOKENS = shipped
            for spec in (s for s in cli.stats_warps.split(",") if s):
                row[f"fused_warps_{spec.replace('/', '_')}_us"] = round(stats_variant_us(spec, n, dim, g, cli.reps), 2)
            for spec in (s for s in cli.tiles.split(",") if s):
                bt, bd = (int(v) for v in spec.split("x"))
                mhc_norm._norm_tiles = lambda n_tok, d, _t=(bt, min(bd, 1 << (dim - 1).bit_length())): _t
                try:
                    row[f"fused_{spec}_us"] = round(site_us("fused", n, dim, g, cli.reps), 2)
                finally:
                    mhc_norm._norm_tiles = default_tiles
            results["time"].append(row)
            print(json.dumps(row), flush=True)
    with open(cli.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print("wrote", cli.out)


if __name__ == "__main__":
    main()
