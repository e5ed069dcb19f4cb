"""Registers and resident programs per SM of the decode MoE kernels, in line and with the shared expert aside.

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/t36 python bench/moe_decode_regs.py [--out bench/results/moe-decode-regs-sm90.json]

CPU only: the launches are recorded under the interpreter (`tests/kernels/test_compile_sm90.py`'s
`Recorder`) and compiled for sm_90 with that test's `COMPILE` step (Triton 3.6 at PYTHONPATH, as the
compile test wants), which reads each cubin's registers and stack. Programs per SM is the register
file's limit, 65 536 / (registers rounded to 8 · threads), capped by 2048 threads and 32 programs.
The V4-Flash expert widths (D 4096, I 2048) at one token, FP8 128×128 or dense bf16 weights, at the
decode table's tiles; the aside's shared-expert kernels also at 512-wide reduction steps ("light"), and
the aside's launches again with the down kernels' registers capped (`DecodeTiles.down_maxnreg`, CAPS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "kernels")]

import test_compile_sm90 as sm90  # noqa: E402
from dspark.kernels import moe_decode  # noqa: E402

DIM, INTER, EXPERTS, TOP_K = 4096, 2048, 16, 6  # V4-Flash widths; 16 experts are enough to compile
CAPS = (160, 200)  # `DecodeTiles.down_maxnreg` values compiled for the SHARED_IN launch (ptxas alone: 128)


def record(kind: str) -> list[tuple[str, dict]]:
    """(label, launch) of each decode kernel launch for one token: in line, aside, light aside."""
    log: list[dict] = []
    kernels = {name: getattr(moe_decode, name) for name in ("_decode_up_kernel", "_decode_down_kernel")}
    for name, kernel in kernels.items():
        setattr(moe_decode, name, sm90.Recorder(kernel, moe_decode.__name__, name, log))
    try:
        launch_all(kind)
    finally:
        for name, kernel in kernels.items():
            setattr(moe_decode, name, kernel)
    labels = ("in line: up", "in line: down", "aside: shared up", "aside: shared down", "aside: routed up",
              "aside: routed down (SHARED_IN)", "light aside: shared up", "light aside: shared down",
              *(f"aside, cap {cap}: {kernel}" for cap in CAPS for kernel in ("shared up", "shared down", "routed up",
                                                                              "routed down (SHARED_IN)")))
    assert len(log) == len(labels), len(log)
    return list(zip(labels, log))


def launch_all(kind: str) -> None:
    """The launches `record` labels, in its order."""
    block = 128 if kind == "fp8_128" else None  # storage only: the launches are recorded, never run
    w1, w2, w3 = (sm90._empty_weight(block, *size) for size in ((EXPERTS, INTER, DIM), (EXPERTS, DIM, INTER),
                                                                (EXPERTS, INTER, DIM)))
    shared = tuple(sm90._empty_weight(block, *size) for size in ((INTER, DIM), (DIM, INTER), (INTER, DIM)))
    x = torch.empty(1, DIM, dtype=torch.bfloat16)
    ids, wts = torch.arange(TOP_K, dtype=torch.int32)[None], torch.empty(1, TOP_K)
    tiles = moe_decode._default_tiles(x, w1, TOP_K)
    moe_decode.decode_experts(x, wts, ids, w1, w2, w3, *shared, 10.0, tiles=tiles)
    pending = moe_decode.SharedAside().start(x, w1, *shared, top_k=TOP_K, swiglu_limit=10.0)
    moe_decode.decode_experts(x, wts, ids, w1, w2, w3, *shared, 10.0, shared=pending)
    moe_decode.decode_shared(x, *shared, 10.0, tiles._replace(up_k=min(tiles.up_k, 512), down_k=min(tiles.down_k, 512)))
    for cap in CAPS:  # the aside again, both down kernels' registers capped
        pending = moe_decode.SharedAside().start(x, w1, *shared, top_k=TOP_K, swiglu_limit=10.0,
                                                 tiles=tiles._replace(down_maxnreg=cap))
        moe_decode.decode_experts(x, wts, ids, w1, w2, w3, *shared, 10.0, shared=pending)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON output path (default: print only)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run under TRITON_INTERPRET=1 (the launches are recorded on the CPU)", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(q for q in sys.path if q)
    rows = []
    for kind in ("fp8_128", "bf16"):
        launches = record(kind)
        done = subprocess.run([sys.executable, "-c", sm90.COMPILE], input=json.dumps([l for _, l in launches]),
                              capture_output=True, text=True, env=env, check=True)
        for (label, launch), res in zip(launches, json.loads(done.stdout.strip().splitlines()[-1])):
            threads = 32 * launch["options"].get("num_warps", 4)
            per_sm = min(65536 // (-(-res["regs"] // 8) * 8 * threads), 2048 // threads, 32)
            rows.append({"weights": kind, "launch": label, "registers": res["regs"], "stack": res["stack"],
                         "threads": threads, "programs_per_sm": per_sm})
            print(f"{kind:8s} {label:32s} {res['regs']:3d} registers x {threads:3d} threads, stack {res['stack']} B"
                  f" -> {per_sm} programs per SM", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"dims": dict(D=DIM, I=INTER, top_k=TOP_K, tokens=1), "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
