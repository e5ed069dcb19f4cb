"""A/B of the V4.1 single-pass mHC site (`mhc_v41.py`) with the statistics pass split over the streams
at a few tokens against the unsplit pass, at decode sizes on one GPU.

    PYTHONPATH=. python bench/mhc_v41_site.py --out $OUT/mhc-v41-site-h200.json   # one H200, ~1-2 min
    PYTHONPATH=. python bench/mhc_v41_site.py --smoke --out /tmp/mhc-v41-site.json  # CPU interpreter, tiny D

Per N (`--tokens`, default 1, 4, 8) at D = 2048 (v41-mini), bf16 streams, 4 streams:

* check: each path's outputs (pre: pre, post, comb, h; post_pre: y and those) against the references
  (‖Δ‖/‖ref‖, largest over the outputs), and whether the split path's h and y equal the unsplit
  ones bit for bit (the collapse u does by construction; h may differ by the Σu² partials' order).
* time: µs per site of a CUDA graph of 12 × (mhc_v41_pre, mhc_v41_post_pre) = 24 sites, distinct
  parameters per site, median of `--reps` replays. Paths: `unsplit` (mhc_v41.SPLIT_STREAMS_MAX_TOKENS
  = 0, the pass before the split), `shipped` (the module's threshold), `before` and
  `split_noprefetch` (unsplit / shipped with triton_compat.PREFETCH off: the statistics pass's L2
  prefetch of fn before its PDL wait came with the split; `before` is the kernel as it was, but for
  the epilogue's vectorised Σu² reduce), and where N is above the threshold `split_forced`
  (threshold N: would the split still pay there?). `--block-d` adds split-path variants of the
  statistics tiles (PRE/POST_PRE D-block widths, and optionally the warps and the token rows; the
  shipped ones are `mhc_v41._v41_tiles`'): narrower blocks mean more D-splits (more programs, more
  partials for the one-round epilogue); a split program holds one stream, so fewer warps may do.

The module constants are rebound in this process only (as bench/mhc_norm_site.py does for V4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

EPS = dict(rms_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20)  # V4.1's eps (spec §1)
N_HC = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mhc-v41-site-h200.json"))
    p.add_argument("--tokens", default="1,4,8", help="comma list of N")
    p.add_argument("--dim", type=int, default=2048, help="hidden size D (v41-mini: 2048)")
    p.add_argument("--reps", type=int, default=200, help="graph replays per timing (median kept)")
    p.add_argument("--block-d", default="32/32,32/16,64/32/4",
                   help="comma list of PRE/POST_PRE[/WARPS[/BLOCK_T]] statistics tiles (D-block widths, warps, "
                        "token rows) timed on the split path")
    p.add_argument("--unsplit-variants", action="store_true",
                   help="time the --block-d variants on the shipped path (unsplit above its threshold: many tokens)")
    p.add_argument("--sites", type=int, default=24, help="mHC sites per graph (half pre, half post_pre)")
    p.add_argument("--sinkhorn-iters", type=int, default=EPS["sinkhorn_iters"],
                   help="Sinkhorn iterations of every site (V4.1: 20); fewer prices the Sinkhorn's share of a site")
    p.add_argument("--smoke", action="store_true",
                   help="CPU interpreter, D = 64, fp32, 2 sites, N = 1 and 8, one wall-clock step (checks the script)")
    return p.parse_args(argv)


def site(dim: int, g: torch.Generator, device: str):
    """One site's (fn [24, 4D], base [24], scale [3], norm weight [D]), fp32."""
    return [t.to(device) for t in (torch.randn(24, N_HC * dim, generator=g) * 0.05, torch.randn(24, generator=g) * 0.5,
                                   torch.rand(3, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5)]


def inputs(n: int, dim: int, dtype: torch.dtype, g: torch.Generator, device: str):
    """x [N, 4, D], f [N, D] (dtype), carried pre [N, 4] and a finished site's (post [N, 4], comb [N, 4, 4])."""
    from dspark.kernels import mhc_v41

    x = torch.randn(n, N_HC, dim, generator=g).to(device, dtype)
    f = torch.randn(n, dim, generator=g).to(device, dtype)
    pre_in = (torch.rand(n, N_HC, generator=g) * 0.9 + 0.1).to(device)
    _, post, comb, _ = mhc_v41.mhc_v41_pre_ref(x, pre_in, *site(dim, g, device), **EPS)
    return x, f, pre_in, post, comb


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


class Variant:
    """A way to run the ops (a context): the module's split threshold and, optionally, the statistics
    D-block widths (pre, post_pre) in place of the shipped decode tiles'."""

    def __init__(self, threshold: int, tiles: tuple[int, ...] | None = None, prefetch: bool = True):
        self.threshold, self.tiles, self.prefetch = threshold, tiles, prefetch

    def __enter__(self):
        from dspark.kernels import mhc_v41, triton_compat

        self.saved = mhc_v41.SPLIT_STREAMS_MAX_TOKENS, mhc_v41._v41_tiles, triton_compat.PREFETCH
        mhc_v41.SPLIT_STREAMS_MAX_TOKENS = self.threshold  # this process only
        triton_compat.PREFETCH = triton_compat.PREFETCH and self.prefetch
        if self.tiles is not None:
            shipped, (bd_pre, bd_post, *rest) = mhc_v41._v41_tiles, self.tiles

            def tiles(n_tok, fused):
                bt, _, shipped_warps = shipped(n_tok, fused)
                warps = rest[0] if rest else shipped_warps
                return rest[1] if len(rest) > 1 else bt, bd_post if fused else bd_pre, warps

            mhc_v41._v41_tiles = tiles
        return self

    def __exit__(self, *exc):
        from dspark.kernels import mhc_v41, triton_compat

        mhc_v41.SPLIT_STREAMS_MAX_TOKENS, mhc_v41._v41_tiles, triton_compat.PREFETCH = self.saved


def check(n: int, dim: int, dtype: torch.dtype, g: torch.Generator, device: str, paths: dict) -> dict:
    from dspark.kernels import mhc_v41

    x, f, pre_in, post, comb = inputs(n, dim, dtype, g, device)
    params = site(dim, g, device)
    ref_pre = mhc_v41.mhc_v41_pre_ref(x, pre_in, *params, **EPS)
    ref_pp = mhc_v41.mhc_v41_post_pre_ref(f, x, post, comb, pre_in, *params, **EPS)
    row, outs = dict(n=n, dim=dim), {}
    for name, path in paths.items():
        with path:
            got_pre = mhc_v41.mhc_v41_pre(x, pre_in, *params, **EPS)
            got_pp = mhc_v41.mhc_v41_post_pre(f, x, post, comb, pre_in, *params, **EPS)
        outs[name] = (got_pre, got_pp)
        row[name] = dict(pre_rel_err=max(rel(o, r) for o, r in zip(got_pre, ref_pre)),
                         post_pre_rel_err=max(rel(o, r) for o, r in zip(got_pp, ref_pp)))
    for name in paths:
        if name != "unsplit":
            (pre_a, pp_a), (pre_b, pp_b) = outs[name], outs["unsplit"]
            row[name].update(h_equal_unsplit=torch.equal(pre_a[3], pre_b[3]) and torch.equal(pp_a[4], pp_b[4]),
                             y_equal_unsplit=torch.equal(pp_a[0], pp_b[0]))
    return row


def graph_timer(reps: int):
    from bench.graph_timing import capture, replay_seconds

    return lambda step: replay_seconds(capture(step), reps)


def wall_timer(step) -> float:
    """Seconds of one step after a compiling one (CPU smoke: checks the plumbing, times nothing real)."""
    step()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def site_us(path: Variant, n: int, dim: int, dtype: torch.dtype, g: torch.Generator, device: str, timer,
            sites: int) -> float:
    """µs per site: sites / 2 × (pre, post_pre) with distinct parameters, in one graph (one step on CPU)."""
    from dspark.kernels import mhc_v41

    params = [site(dim, g, device) for _ in range(sites)]
    x, f, pre_in, post, comb = inputs(n, dim, dtype, g, device)

    def step():
        for i in range(sites // 2):
            mhc_v41.mhc_v41_pre(x, pre_in, *params[2 * i], **EPS)
            mhc_v41.mhc_v41_post_pre(f, x, post, comb, pre_in, *params[2 * i + 1], **EPS)

    with path:
        return round(timer(step) * 1e6 / sites, 2)


def run(args) -> dict:
    from dspark.kernels import mhc_v41

    if args.sinkhorn_iters < 1:
        raise ValueError(f"--sinkhorn-iters must be >= 1, got {args.sinkhorn_iters}")
    EPS["sinkhorn_iters"] = args.sinkhorn_iters  # this process only
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    dim = 64 if args.smoke else args.dim
    timer = wall_timer if args.smoke else graph_timer(args.reps)
    tokens = [1, 8] if args.smoke else [int(t) for t in args.tokens.split(",")]
    sites = 2 if args.smoke else args.sites
    shipped = mhc_v41.SPLIT_STREAMS_MAX_TOKENS
    variants = [tuple(int(v) for v in spec.split("/")) for spec in args.block_d.split(",") if spec]
    g = torch.Generator().manual_seed(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=REPO).stdout.strip()
    except OSError:
        commit = ""
    import triton

    result = {"conditions": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
                             "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
                             "dtype": str(dtype).removeprefix("torch."), "dim": dim, "n_hc": N_HC,
                             "sites_per_graph": sites, "reps": args.reps, "smoke": args.smoke,
                             "sinkhorn_iters": args.sinkhorn_iters,
                             "split_streams_max_tokens": shipped,
                             "shipped_block_d": [mhc_v41._v41_tiles(1, False)[1], mhc_v41._v41_tiles(1, True)[1]]},
              "check": [], "time": []}
    for n in tokens:
        paths = {"unsplit": Variant(0), "before": Variant(0, prefetch=False), "shipped": Variant(shipped),
                 "split_noprefetch": Variant(shipped, prefetch=False)}
        if n > shipped:
            paths["split_forced"] = Variant(n)
        for tiles in variants:
            if args.unsplit_variants:  # the variants on the path N takes (unsplit above the threshold)
                paths["tiles_" + "_".join(map(str, tiles))] = Variant(shipped, tiles)
            else:
                paths["split_" + "_".join(map(str, tiles))] = Variant(max(n, shipped), tiles)
        row = check(n, dim, dtype, g, device, paths)
        result["check"].append(row)
        print(json.dumps(row), flush=True)
        row = dict(n=n, dim=dim, **{f"{name}_us": site_us(p, n, dim, dtype, g, device, timer, sites)
                                        for name, p in paths.items()})
        row["speedup_shipped_vs_unsplit"] = round(row["unsplit_us"] / row["shipped_us"], 3)
        row["speedup_shipped_vs_before"] = round(row["before_us"] / row["shipped_us"], 3)
        result["time"].append(row)
        print(json.dumps(row), flush=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
        sys.path.insert(0, str(REPO / "tests" / "kernels"))
        import conftest  # noqa: F401  (the interpreter's patches: scalar loop bounds under NumPy >= 2.4)
    elif not torch.cuda.is_available():
        print("mhc_v41_site.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
