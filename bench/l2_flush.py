"""How much of a decode op's time `graph_timer`'s L2 flush adds: the same ops after a write flush and a read flush.

    python bench/l2_flush.py --out $OUT/l2-flush.json      # ≈ 2 min

`bench.attn_batched.graph_timer` replays (flush, op) and the flush alone from CUDA graphs and subtracts.
Its write flush (a 256 MB `zero_`, as `triton.testing.do_bench` does) leaves the L2 full of dirty lines,
which the op's reads then evict: the op pays for writing them back, and the flush alone, timed without the
op, does not. A read flush (a max over 256 MB) writes them back inside the flush. Cases, each timed after
either flush, in turn, for `--rounds` rounds (medians):

* `read_stream`: a plain read of as many bytes as the op at hand (`torch.amax` over int8), the control;
* issue 6's whole MoE op (`bench/kernels.py`'s `fused_moe`, `fused_moe_fp8_128`, `fused_moe_fp8_32` on the
  V4-Flash layer, router included) at `--tokens`.

% HBM against 4.4 TB/s (issue 6's ceiling) and against this card's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attn_batched import FLUSHES, copy_bytes_per_s, graph_timer  # noqa: E402
from moe_decode_tma import HBM, rate  # noqa: E402
from provenance import git_commit  # noqa: E402

OPS = ("fused_moe_fp8_128", "fused_moe_fp8_32", "fused_moe")


def rates(n_bytes: int, times: dict, copy_bps: float) -> dict:
    """flush -> {us, pct_hbm, copy_pct} of the median of each flush's rounds."""
    return {flush: rate(n_bytes, statistics.median(seconds), copy_bps) for flush, seconds in times.items()}


def timed(fn, rounds: int) -> dict:
    """flush -> seconds of each round, the flushes in turn within a round."""
    times = {flush: [] for flush in FLUSHES}
    for _ in range(rounds):
        for flush in FLUSHES:
            times[flush].append(graph_timer(fn, flush=flush))
    return times


def case_row(case: str, m: int, n_bytes: int, fn, rounds: int, copy_bps: float) -> dict:
    times = timed(fn, rounds)
    r = {"case": case, "M": m, "bytes": n_bytes, "rounds_s": times, **rates(n_bytes, times, copy_bps)}
    r["write_over_read"] = r["write"]["us"] / r["read"]["us"]
    write, read = r["write"], r["read"]
    print(f"{case} M={m} ({n_bytes / 1e6:.1f} MB): write flush {write['us']:.1f} us ({write['pct_hbm']:.1f} % HBM), "
          f"read flush {read['us']:.1f} us ({read['pct_hbm']:.1f} % HBM, {read['copy_pct']:.1f} % copy); "
          f"{r['write_over_read']:.3f}x", flush=True)
    return r


def stream_row(m: int, n_bytes: int, rounds: int, copy_bps: float) -> dict:
    """The control: a plain read of n_bytes (`torch.amax` over int8 ones), after either flush."""
    stream = torch.ones(n_bytes, dtype=torch.int8, device="cuda")
    return case_row("read_stream", m, n_bytes, lambda: torch.amax(stream), rounds, copy_bps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/l2-flush.json")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import kernels as kb

    copy_bps = copy_bytes_per_s(torch.device("cuda"))
    shape = kb.CONFIGS["flash"]
    layer = kb.build_layer(shape, "cuda")
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
                  "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size, "hbm_bytes_per_s": HBM,
                  "copy_bytes_per_s": copy_bps, "layer": shape.name, "rounds": args.rounds,
                  "timing": "graph_timer (CUDA-graph replays, median of 50) after each flush, in turn"}
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for op, m in itertools.product(args.ops.split(","), [int(t) for t in args.tokens.split(",")]):
            fused, ref, n_bytes, _ = kb.moe_case(op, shape, layer, m, "cuda")
            rows.append(stream_row(m, n_bytes, args.rounds, copy_bps))
            rows.append(case_row(op, m, n_bytes, fused, args.rounds, copy_bps))
            y, y_ref = fused(), ref()
            rows[-1]["rel_err"] = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
            out.write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
