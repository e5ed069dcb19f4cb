"""The Markov head's greedy slot: torch (F.linear + add + greedy) against the fused `markov_greedy`.

    PYTHONPATH=. python bench/markov_greedy.py --out $OUT/markov-greedy-h200.json            # one H200, ~2 min
    PYTHONPATH=. python bench/markov_greedy.py --sweep --out $OUT/markov-greedy-sweep-h200.json   # + tile sweep
    PYTHONPATH=. python bench/markov_greedy.py --smoke --out /tmp/markov-greedy.json          # CPU interpreter, tiny

One greedy slot of the DSpark drafter's vanilla Markov head (`dspark.kernels.markov_greedy`):
tokens = argmax(base[S, V].float() + E[S, r] · W2[V, r]ᵀ), V = 129280 (v4-mini / V4's vocabulary),
r = `--rank` (default: the v4-mini drafter's, `DSparkConfig.from_dict(v4-mini).dspark_markov_rank`),
S ∈ `--rows` (1: one request; 8, 64, 128, 256: requests × the static drafter's slots). fp32 base and
weights, random normal data (`--base-dtype bf16` for a bf16 base).

Per S, three variants, each timed as a CUDA-graph replay with L2 flushed
(`bench.attn_batched.graph_timer`, what the op costs inside the drafter's captured step; capturing
it also checks that the op has no host sync):

* `ref`: `markov_greedy_ref` (cuBLAS FP32 GEMM, add, `dspark.sampling.greedy`);
* `tf32x3`: `markov_greedy` at its default precision (3-pass TF32 tensor cores);
* `ieee`: `markov_greedy(..., input_precision="ieee")` (fp32 FMAs).

Each reports µs per call, GB/s of W2 read (V·r·4 bytes; the op must stream W2 at least once) and its
% of 4.4 TB/s (the H200's measured copy bandwidth), the bytes the op must move at least (W2, base,
E) as `min_bytes` and its % of HBM, and token mismatches against `ref` with the smallest top-1/top-2
logit margin of the reference's fp64 logits (how close a row came to a near-tie). `--sweep` also
times a grid of `Tiles` per S for the tf32x3 kernel (`sweep` rows), to refit `_TILE_TABLE`.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.latency_kernels import bench_device  # noqa: E402 (imports torch only)

HBM_BYTES_PER_S = 4.4e12  # measured H200 copy bandwidth (bench/README.md)
SMOKE = dict(rows=(1, 5, 17), vocab=300, rank=32)


def default_rank() -> int:
    """The v4-mini drafter's Markov rank (v4-mini's config.json has no dspark_* keys: DSparkConfig's default)."""
    from dspark.configs import load_config
    from dspark.draft.config import DSparkConfig

    return DSparkConfig.from_dict(load_config("v4-mini")).dspark_markov_rank


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ.get("OUT", "bench/results")) / "markov-greedy-h200.json"
    p.add_argument("--out", default=str(default_out))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the script")
    p.add_argument("--rows", default="1,8,64,128,256", help="comma-separated S values")
    p.add_argument("--rank", type=int, default=None, help="Markov rank r (default: the v4-mini drafter's)")
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--base-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--reps", type=int, default=50, help="graph replays timed (median)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tiles per S (tf32x3)")
    p.add_argument("--sweep-seconds", type=float, default=120.0, help="wall-clock budget of the sweep per S")
    return p.parse_args(argv)


def conditions(device, args, vocab: int, rank: int) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = {"torch": torch.__version__, "date": now,
            "smoke": args.smoke, "vocab": vocab, "rank": rank, "base_dtype": args.base_dtype, "reps": args.reps,
            "timing": "CUDA graph replay, L2 flushed (bench.attn_batched.graph_timer), median"}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from provenance import git_commit

    info["commit"] = git_commit()
    info["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def inputs(n_rows: int, vocab: int, rank: int, base_dtype: torch.dtype, device, seed: int):
    """Random normal base [S, V], E [S, r], W2 [V, r], scaled like a trained head's (bias ~ N(0, 1))."""
    g = torch.Generator(device=device).manual_seed(seed)
    base = torch.randn(n_rows, vocab, generator=g, device=device).to(base_dtype)
    embed = torch.randn(n_rows, rank, generator=g, device=device)
    weight = torch.randn(vocab, rank, generator=g, device=device) * rank**-0.5
    return base, embed, weight


def margin(base, embed, weight) -> float:
    """Smallest gap between a row's top two logits, in fp64 (how near a tie any row came)."""
    logits = base.double() + embed.double() @ weight.double().T
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def sweep_tiles(n_rows: int, rank: int):
    """The tile grid `--sweep` times at S = n_rows: BLOCK_S the rows rounded up to a power of two
    (16 to 128) and 64 below that where S > 64, both product orientations, a few V / r tiles and warps."""
    from dspark.kernels.markov_greedy import Tiles

    full = max(16, min(128, 1 << max(0, n_rows - 1).bit_length()))
    block_s_options = sorted({full, 64} if n_rows > 64 else {full})
    for block_s, swap, block_v, block_r, warps, stages in itertools.product(
            block_s_options, (True, False), (64, 128, 256), (32, 64), (4, 8), (3, 4)):
        if block_r > max(16, rank) or block_s * block_v > 128 * 128 or (stages == 4 and block_v == 256):
            continue
        yield Tiles(block_s, block_v, block_r, swap, warps, stages)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bench_device(args.smoke, "bench/markov_greedy.py")
    if device is None:
        return 2
    from dspark.kernels.markov_greedy import default_tiles, markov_greedy, markov_greedy_ref

    rows_list = SMOKE["rows"] if args.smoke else tuple(int(s) for s in args.rows.split(","))
    vocab = SMOKE["vocab"] if args.smoke else args.vocab
    rank = args.rank if args.rank is not None else (SMOKE["rank"] if args.smoke else default_rank())
    base_dtype = torch.bfloat16 if args.base_dtype == "bf16" else torch.float32
    if args.smoke:
        timer = None
    else:
        from bench.attn_batched import graph_timer

        def timer(fn):
            return graph_timer(fn, reps=args.reps)
    cond = conditions(device, args, vocab, rank)
    print(json.dumps(cond), flush=True)
    variants = {"ref": markov_greedy_ref,
                "tf32x3": lambda *a: markov_greedy(*a, input_precision="tf32x3"),
                "ieee": lambda *a: markov_greedy(*a, input_precision="ieee")}
    w2_bytes = vocab * rank * 4
    results, sweep = [], []
    with torch.inference_mode():
        for n_rows in rows_list:
            base, embed, weight = inputs(n_rows, vocab, rank, base_dtype, device, seed=n_rows)
            min_bytes = w2_bytes + base.numel() * base.element_size() + embed.numel() * 4
            want = markov_greedy_ref(base, embed, weight)
            shipped = {p: default_tiles(n_rows, rank, p)._asdict() for p in ("tf32x3", "ieee")}
            row = {"S": n_rows, "V": vocab, "r": rank, "tiles": shipped,
                   "min_margin": margin(base, embed, weight), "w2_bytes": w2_bytes, "min_bytes": min_bytes}
            for name, fn in variants.items():
                got = fn(base, embed, weight)
                cell = {"mismatches": int((got != want).sum())}
                if timer is not None:
                    seconds = timer(lambda: fn(base, embed, weight))
                    cell.update(us=seconds * 1e6, w2_GBps=w2_bytes / seconds / 1e9,
                                w2_pct_hbm=100 * w2_bytes / seconds / HBM_BYTES_PER_S,
                                min_bytes_pct_hbm=100 * min_bytes / seconds / HBM_BYTES_PER_S)
                row[name] = cell
            if timer is not None:
                row["speedup_tf32x3"] = row["ref"]["us"] / row["tf32x3"]["us"]
                row["speedup_ieee"] = row["ref"]["us"] / row["ieee"]["us"]
            print(json.dumps(row), flush=True)
            results.append(row)
            if args.sweep:
                start = time.time()
                for tiles in sweep_tiles(n_rows, rank):
                    if time.time() - start > args.sweep_seconds:
                        sweep.append({"S": n_rows, "note": "sweep budget spent; later tiles not timed"})
                        break
                    cell = {"S": n_rows, "tiles": tiles._asdict()}
                    try:
                        got = markov_greedy(base, embed, weight, tiles=tiles)
                        cell["mismatches"] = int((got != want).sum())
                        if timer is not None:
                            cell["us"] = timer(lambda: markov_greedy(base, embed, weight, tiles=tiles)) * 1e6
                    except Exception as e:  # out of shared memory / registers for this shape: record, go on
                        cell["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    sweep.append(cell)
                    if args.smoke and len([c for c in sweep if c["S"] == n_rows]) >= 2:
                        break  # the interpreter is slow: two cells per S check the path
                best = sorted((c for c in sweep if c["S"] == n_rows and "us" in c and not c["mismatches"]),
                              key=lambda c: c["us"])[:5]
                for c in best:
                    print("  sweep", json.dumps(c), flush=True)
            del base, embed, weight
    summary = [f"S={r['S']:4d} ref {r['ref']['us']:8.1f} us  tf32x3 {r['tf32x3']['us']:7.1f} us "
               f"({r['tf32x3']['w2_pct_hbm']:5.1f}% HBM of W2, x{r['speedup_tf32x3']:.2f})  "
               f"ieee {r['ieee']['us']:7.1f} us "
               f"(x{r['speedup_ieee']:.2f})  mismatches {r['tf32x3']['mismatches']}/{r['ieee']['mismatches']}"
               for r in results if "us" in r["ref"]]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"conditions": cond, "results": results, "summary": summary}
    if args.sweep:
        payload["sweep"] = sweep
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(summary))
    bad = [r["S"] for r in results if any(r[v]["mismatches"] for v in ("tf32x3", "ieee"))]
    print(f"wrote {out} ({len(results)} rows){'; MISMATCHES at S=' + str(bad) if bad else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
