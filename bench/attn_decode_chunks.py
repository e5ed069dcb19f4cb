"""How finely the fused sparse attention splits a decode query's keys (`Tiles.min_chunk_tiles`).

    PYTHONPATH=. python bench/attn_decode_chunks.py --out $OUT/attn-decode-chunks.json   # one H200, ~1 min

v4-mini's decode attention (32 heads × 512, bf16) for B ∈ {1, 8, 64} requests with one query each, at
4K and 32K context: CSA keys = window 128 + top-512 picks, HCA keys = window 128 + every complete entry
(rate 128: 32 at 4K, 256 at 32K). Each case runs the partial + combine launches with at least 1, 2 or
4 key tiles of 32 per chunk (fewer tiles per chunk: more programs for few queries, more partials to
combine), timed as CUDA-graph replays with L2 flushed (`bench.attn_batched.graph_timer`); outputs are
compared with the torch reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.attn_batched import HBM_BYTES_PER_S, HEAD_DIM, decode_inputs, graph_timer  # noqa: E402
from dspark.kernels import attention  # noqa: E402

HEADS = 32
CASES = {"csa": (4, 512), "hca": (128, None)}  # rate, top-k (None: every entry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/attn-decode-chunks.json")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for context in (4096, 32768):
        for kind, (rate, topk) in CASES.items():
            for batch in (1, 8, 64):
                q, pool, index, sink, _ = decode_inputs(batch, HEADS, rate, topk, context, "cuda", g)
                ref = attention.sparse_attention_ref(q, pool, index, sink, scale).float()
                n_bytes = batch * index.shape[1] * HEAD_DIM * 2 + 2 * q.numel() * 2 + index.numel() * 8
                for tiles_per_chunk in (1, 2, 4):
                    tiles = dataclasses.replace(attention.default_tiles(HEADS, HEAD_DIM), min_chunk_tiles=tiles_per_chunk)
                    out = attention.launch_sparse_attention(q, pool, index, sink, scale, tiles).float()
                    t = graph_timer(lambda: attention.launch_sparse_attention(q, pool, index, sink, scale, tiles))
                    rows.append({"context": context, "kind": kind, "B": batch, "keys": index.shape[1],
                                 "min_chunk_tiles": tiles_per_chunk, "us": t * 1e6,
                                 "pct_hbm": 100 * n_bytes / t / HBM_BYTES_PER_S,
                                 "rel_err": ((out - ref).norm() / ref.norm()).item()})
                    print(json.dumps(rows[-1]), flush=True)
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": HEADS,
                  "head_dim": HEAD_DIM, "timing": "graph_timer (L2 flushed)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
