"""The decode MoE's two kernels overlapped: the up kernel launched with PDL whatever its grid
(`DecodeTiles.up_pdl`) and the down kernel's weights asked into L2 before its PDL wait
(`DecodeTiles.down_prefetch`), against the shipped launch, at one token.

    python bench/moe_decode_overlap.py --out $OUT/moe-decode-overlap.json     # one GPU, ~1 min

For each layer (`bench/kernels.py`'s V4-Flash and v4-mini) and weight kind, the fused MoE as one op
(`moe.fused_moe`: router, up, down; what `kernels.py --ops fused_moe...` times) replayed from a CUDA
graph with L2 flushed (`bench.attn_batched.graph_timer`), at the shipped `decode_tiles` shape and at
variants of it. Why it might pay: a large up grid (V4-Flash: 1792 programs) launches without PDL, so
the down kernel is scheduled only once the up kernel has finished; with PDL it is scheduled as the up
kernel's last wave retires (every up program has then signalled), and a down program that prefetches
its rows before its wait streams them while the up kernel still runs. The bytes and % of HBM are
`kernels.py`'s (router, picked experts, shared expert, x). Each variant's output is compared with the
shipped shape's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/kernels.py imports its siblings by name

from bench.kernels import CONFIGS, build_layer, moe_case  # noqa: E402

HBM = 4.4e12
KINDS = {"fp8_128": 128, "fp8_32": 32, "bf16": None}


def variants(shipped, rows_bytes: int) -> dict:
    """name -> DecodeTiles: the shipped shape, with PDL on the up launch, and with prefetches of 32 KB,
    a third, two thirds and all of each down program's rows (`rows_bytes`: K + 1 experts' row blocks)."""
    out = {"shipped": shipped, "up_pdl": shipped._replace(up_pdl=True)}
    for size in sorted({32 << 10, rows_bytes // 48 * 16, rows_bytes // 24 * 16, rows_bytes // 16 * 16}):
        out[f"up_pdl+prefetch_{size}"] = shipped._replace(up_pdl=True, down_prefetch=size)
    out["prefetch_all_no_up_pdl"] = shipped._replace(down_prefetch=rows_bytes // 16 * 16)
    return out


def run_layer(shape, layer: dict, kind: str, timer) -> list[dict]:
    """Every variant of one layer (`build_layer`'s parameters) and weight kind, timed and bit-compared."""
    from dspark.kernels import moe_decode

    block = KINDS[kind]
    op = "fused_moe" if block is None else f"fused_moe_{kind}"
    fused, _, n_bytes, _ = moe_case(op, shape, layer, 1, "cuda")
    shipped = moe_decode.decode_tiles(1, block, shape.dim)
    elt = 2 if block is None else 1
    rows_bytes = (shape.top_k + 1) * shape.inter * min(shipped.down_n, shape.dim) * elt
    pick = moe_decode.decode_tiles
    rows, base = [], None
    try:
        for name, tiles in variants(shipped, rows_bytes).items():
            moe_decode.decode_tiles = lambda n, b, d, t=tiles: t  # this bench's variant for every call
            y = fused()
            base = y if base is None else base
            seconds = timer(fused)
            rows.append({"layer": shape.name, "kind": kind, "variant": name, "tiles": tiles._asdict(),
                         "us": seconds * 1e6, "pct_hbm": 100 * n_bytes / seconds / HBM,
                         "same_bits": bool(torch.equal(y, base))})
            print(f"{shape.name} {kind} {name}: {seconds * 1e6:.1f} us ({rows[-1]['pct_hbm']:.1f} % HBM) "
                  f"same bits {rows[-1]['same_bits']}", flush=True)
    finally:
        moe_decode.decode_tiles = pick
    return rows


def main() -> None:
    from bench.attn_batched import graph_timer

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe-decode-overlap.json")
    ap.add_argument("--configs", default="flash,mini", help=f"comma list of {sorted(CONFIGS)}")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {tuple(KINDS)}")
    args = ap.parse_args()
    configs, kinds = args.configs.split(","), args.kinds.split(",")
    if not set(configs) <= set(CONFIGS) or not set(kinds) <= set(KINDS):
        raise SystemExit(f"--configs from {sorted(CONFIGS)}, --kinds from {tuple(KINDS)}")
    rows = []
    for c in configs:
        layer = build_layer(CONFIGS[c], "cuda")
        rows += [r for k in kinds for r in run_layer(CONFIGS[c], layer, k, graph_timer)]
        del layer
        torch.cuda.empty_cache()
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_bytes_per_s": HBM,
                  "tokens": 1, "timing": "graph_timer (CUDA-graph replay, L2 flushed)", "op": "moe.fused_moe"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
