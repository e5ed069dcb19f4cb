"""The mHC epilogues at decode sizes: the folded V4 site epilogue (`mhc_norm._mhc_norm_epilogue_kernel`)
and the unfused one (`mhc._mhc_epilogue_kernel`), alone and inside whole sites, on one GPU.

Variants of the folded epilogue (`mhc_norm._launch_norm_epilogue(variant=...)`): "walk" (token blocks
that walk the row twice, Sinkhorn in one program), "row" (shipped: the row in registers, one walk,
Sinkhorn on a second program), and "row" at other warp counts. The kernels' former orders, which earlier
runs of this script timed as "legacy" (`bench/results/mhc-epilogue-h200.json`), left the library in the
forty-fourth session (git history has them).

Per (N, D) in {1, 4} x {2048, 4096}, bf16:
* check: every variant's (post, comb, h) against the walk's (bit-equal or the largest difference)
  and against the torch references (‖Δ‖/‖ref‖);
* epilogue_us: µs per launch in a CUDA graph of 24 epilogues, each on its own site's statistics
  partials (written once before the capture), median of replays;
* site_us: µs per site in a graph of 12 x (pre, post_pre) folded sites (`mhc_norm_site.site_us`,
  statistics pass + epilogue per site), per variant; the unfused pair (mhc_pre / mhc_post_pre then
  rms_norm) for reference.

    PYTHONPATH=. python bench/mhc_epilogue.py                      # H200: ~1-2 min, writes $OUT/mhc-epilogue-h200.json
    PYTHONPATH=. python bench/mhc_epilogue.py --smoke --out /tmp/e.json   # CPU interpreter: checks the script
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.latency_kernels import interpreter_setup  # noqa: E402 (imports torch only)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mhc-epilogue-h200.json"))
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--dims", default="2048,4096")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warps", default="4,8,16", help="num_warps of the 'row' variant timed besides the shipped one")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    return ap.parse_args(argv)


def variants(dim: int, warps: list[int]) -> dict:
    """name -> keyword arguments of `mhc_norm._launch_norm_epilogue`."""
    from dspark.kernels import mhc_norm

    out = {"walk": dict(variant="walk"), "row": dict(variant="row")}
    shipped = mhc_norm.row_tiles(1, dim)
    for w in warps:
        if shipped is not None and w != shipped[1]:
            out[f"row_w{w}"] = dict(variant="row", tiles=(shipped[0], w))
    return out


def sites(n: int, dim: int, count: int, g: torch.Generator, device: str):
    """`count` sites: (x [N, 4, D] bf16, fn, base, scale, norm weight, dpart, sqpart) with the statistics
    partials of x written by the shipped statistics pass."""
    from mhc_norm_site import site

    from dspark.kernels import mhc

    out = []
    for _ in range(count):
        params = [t.to(device) for t in site(dim, g)] if device == "cuda" else site_cpu(dim, g)
        x = torch.randn(n, 4, dim, generator=g).to(device).bfloat16()
        dpart, sqpart = mhc._launch_stats(x, params[0], 4, dim)
        out.append((x, *params, dpart, sqpart))
    return out


def site_cpu(dim: int, g: torch.Generator):
    """As `mhc_norm_site.site`, on the CPU (smoke)."""
    return [torch.randn(24, 4 * dim, generator=g) * 0.05, torch.randn(24, generator=g) * 0.5,
            torch.rand(3, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5]


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    return dict(equal=torch.equal(a, b), max_abs=(a.double() - b.double()).abs().max().item())


def check(n: int, dim: int, one, kinds: dict) -> dict:
    """Each folded variant vs the walk and the references."""
    from mhc_norm_site import EPS, NORM_EPS, rel

    from dspark.kernels import mhc, mhc_norm

    x, fn, base, scale, w, dpart, sqpart = one
    eps = dict(**EPS, norm_eps=NORM_EPS)
    ref = mhc_norm.mhc_pre_norm_ref(x, fn, base, scale, w, **EPS, norm_eps=NORM_EPS)
    walk = mhc_norm._launch_norm_epilogue(x, dpart, sqpart, base, scale, w, eps, variant="walk")
    row = dict(n=n, dim=dim, folded={})
    for name, kw in kinds.items():
        got = mhc_norm._launch_norm_epilogue(x, dpart, sqpart, base, scale, w, eps, **kw)
        row["folded"][name] = {k: diff(a, b) for k, a, b in zip(("post", "comb", "h"), got, walk)}
        row["folded"][name]["rel_err_vs_ref"] = max(rel(a, b) for a, b in zip(got, ref))
    unfused = mhc._launch_epilogue(x, dpart, sqpart, base, scale, *EPS.values())
    row["unfused_rel_err_vs_ref"] = max(rel(a, b) for a, b in zip(unfused, mhc.mhc_pre_ref(x, fn, base, scale, **EPS)))
    return row


def epilogue_us(batch, kw: dict, reps: int, unfused: bool = False) -> float:
    """µs per launch: a CUDA graph of one epilogue per site of `batch` (24), statistics partials fixed."""
    from graph_timing import capture, replay_seconds
    from mhc_norm_site import EPS, NORM_EPS

    from dspark.kernels import mhc, mhc_norm

    eps = dict(**EPS, norm_eps=NORM_EPS)

    def step():
        for x, fn, base, scale, w, dpart, sqpart in batch:
            if unfused:
                mhc._launch_epilogue(x, dpart, sqpart, base, scale, *EPS.values(), **kw)
            else:
                mhc_norm._launch_norm_epilogue(x, dpart, sqpart, base, scale, w, eps, **kw)

    return replay_seconds(capture(step), reps) * 1e6 / len(batch)


def site_us(path: str, n: int, dim: int, g: torch.Generator, reps: int, folded_kw: dict):
    """µs per site of `mhc_norm_site.site_us` with the folded epilogue's launcher bound to one variant."""
    import mhc_norm_site

    from dspark.kernels import mhc_norm

    launch_norm = mhc_norm._launch_norm_epilogue
    mhc_norm._launch_norm_epilogue = functools.partial(launch_norm, **folded_kw)  # this process only
    try:
        return mhc_norm_site.site_us(path, n, dim, g, reps)
    finally:
        mhc_norm._launch_norm_epilogue = launch_norm


def run(args) -> dict:
    sys.path.insert(0, HERE)
    device = "cpu" if args.smoke else "cuda"
    tokens = [1] if args.smoke else [int(t) for t in args.tokens.split(",")]
    dims = [256] if args.smoke else [int(d) for d in args.dims.split(",")]
    warps = [int(w) for w in args.warps.split(",") if w]
    g = torch.Generator().manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    result = {"conditions": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                             "torch": torch.__version__, "commit": commit.strip(), "dtype": "bfloat16",
                             "sites_per_graph": 24, "reps": args.reps, "smoke": args.smoke,
                             "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "check": [], "epilogue_us": [], "site_us": []}
    for n in tokens:
        for dim in dims:
            kinds = variants(dim, warps)
            batch = sites(n, dim, 2 if args.smoke else 24, g, device)
            row = check(n, dim, batch[0], kinds)
            result["check"].append(row)
            print(json.dumps(row), flush=True)
            if args.smoke:
                continue
            times = dict(n=n, dim=dim, **{name: round(epilogue_us(batch, kw, args.reps), 2) for name, kw in kinds.items()})
            times["unfused"] = round(epilogue_us(batch, {}, args.reps, unfused=True), 2)
            result["epilogue_us"].append(times)
            print(json.dumps(times), flush=True)
            sites_row = dict(n=n, dim=dim)
            for name in ("walk", "row"):
                sites_row[f"folded_{name}"] = round(site_us("fused", n, dim, g, args.reps, kinds[name]), 2)
            sites_row["unfused"] = round(site_us("unfused", n, dim, g, args.reps, {}), 2)
            result["site_us"].append(sites_row)
            print(json.dumps(sites_row), flush=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        interpreter_setup()
    elif not torch.cuda.is_available():
        print("mhc_epilogue.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    result = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
