"""The MoE packing step (assignments grouped by expert, dspark/kernels/moe.py): `_pack_kernel` (one
launch) against the torch packing (`_pack_by_expert`, ~27 launches), and the whole packed MoE of a
v4-mini layer with each, timed as CUDA-graph replays.

    PYTHONPATH=. python bench/moe_pack.py --out $OUT/moe-pack-h200.json      # one H200, < 1 min

`pack` rows: E ∈ {64, 256, 384} experts, N·K assignments from 96 to the kernel's bound (8190),
random expert ids, BLOCK_M 16; `equal`: the kernel's three outputs equal the torch packing's.
`moe` rows: `_packed_experts` of v4-mini (hidden 2048, 64 experts × 512, top-6, bf16) at 64 and 256
tokens, with the kernel and with the torch packing (`_pack_assignments` swapped). `us` from
`bench.attn_batched.graph_timer` (L2 flushed, launch overhead removed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.attn_batched import graph_timer  # noqa: E402
from dspark.kernels import moe  # noqa: E402

ASSIGNMENTS = (96, 768, 1536, 6144, 8190)
EXPERTS = (64, 256, 384)


def pack_rows(g) -> list[dict]:
    rows = []
    for n_exp in EXPERTS:
        for n_assign in ASSIGNMENTS:
            ids = torch.randint(0, n_exp, (n_assign, 1), generator=g, device="cuda", dtype=torch.int32)
            equal = all(torch.equal(a, b) for a, b in zip(moe._launch_pack(ids, n_exp, 16),
                                                         moe._pack_by_expert(ids, n_exp, 16)))
            kernel_s = graph_timer(lambda: moe._launch_pack(ids, n_exp, 16))
            torch_s = graph_timer(lambda: moe._pack_by_expert(ids, n_exp, 16))
            rows.append(dict(case="pack", experts=n_exp, assignments=n_assign, us=kernel_s * 1e6,
                             torch_us=torch_s * 1e6, speedup=torch_s / kernel_s, equal=equal))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def moe_rows(g) -> list[dict]:
    rows = []
    dim, n_exp, inter, top_k = 2048, 64, 512, 6
    w = lambda *shape: (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).bfloat16()  # noqa: E731
    w1, w3, w2 = w(n_exp, inter, dim), w(n_exp, inter, dim), w(n_exp, dim, inter)
    s1, s3, s2 = w(inter, dim), w(inter, dim), w(dim, inter)
    for n_tok in (64, 256):
        x = torch.randn(n_tok, dim, generator=g, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(n_exp, generator=g, device="cuda")[:top_k] for _ in range(n_tok)]).int()
        weights = torch.rand(n_tok, top_k, generator=g, device="cuda")
        run = lambda: moe._packed_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0)  # noqa: E731
        kernel_s = graph_timer(run)
        kernel_y = run()
        original = moe._pack_assignments
        moe._pack_assignments = moe._pack_by_expert  # the torch packing for the comparison
        try:
            torch_s = graph_timer(run)
            torch_y = run()
        finally:
            moe._pack_assignments = original
        rows.append(dict(case="moe", tokens=n_tok, us=kernel_s * 1e6, torch_pack_us=torch_s * 1e6,
                         speedup=torch_s / kernel_s, equal=torch.equal(kernel_y, torch_y)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    cli = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"conditions": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                             "timer": "graph_timer (CUDA-graph replays, L2 flushed)",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "rows": pack_rows(g) + moe_rows(g)}
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
