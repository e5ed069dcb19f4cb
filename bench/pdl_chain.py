"""Does programmatic dependent launch (PDL) shorten a chain of small kernels in a CUDA graph?

    PYTHONPATH=. python bench/pdl_chain.py --out $OUT/pdl-chain.json      # one H200, ~20 s

A batch-1 decode step is ~500 dependent kernels of a few µs each, replayed from one CUDA graph; each
boundary costs the GPU the drain of one grid and the launch of the next. With PDL (Hopper) a kernel
launched with `launch_pdl=True` may start while its predecessor runs and waits in
`griddepcontrol.wait` (Triton: `gdc_wait`) until the predecessor's memory is visible; a predecessor
that calls `gdc_launch_dependents` lets it be scheduled early. This chains K launches of one
elementwise kernel (each reads the previous one's output: a true dependency) as a graph, in three
variants: `plain` (no PDL), `pdl` (wait and release at the top), `pdl_tail` (wait at the top, release
after the store), at two sizes (`tiny`: 4 programs of 1 K elements; `wide`: 264 programs of 8 K),
and reports µs per kernel (graph replay / K, median of 20) and whether every variant's result equals
the plain chain's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.graph_timing import replay_seconds  # noqa: E402

K = 256
SIZES = {"tiny": (4, 1024), "wide": (264, 8192)}  # programs, elements per program
VARIANTS = {"plain": (0, False), "pdl": (1, True), "pdl_tail": (2, True)}  # MODE, launch_pdl


@triton.jit
def _step(x_ptr, y_ptr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    if MODE != 0:
        tlc.gdc_wait()  # the predecessor's writes are visible from here on
    if MODE == 1:
        tlc.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 0.5 + 1.0)
    if MODE == 2:
        tlc.gdc_launch_dependents()


def chain(bufs, programs: int, block: int, mode: int, pdl: bool) -> None:
    for i in range(K):
        _step[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], BLOCK=block, MODE=mode, launch_pdl=pdl)


def timed(programs: int, block: int, mode: int, pdl: bool, start: torch.Tensor) -> tuple[float, torch.Tensor]:
    bufs = [start.clone(), torch.empty_like(start)]
    chain(bufs, programs, block, mode, pdl)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(bufs, programs, block, mode, pdl)
    bufs[0].copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    result = bufs[K % 2].clone()
    return replay_seconds(graph, 20) * 1e6 / K, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/pdl-chain.json")
    args = ap.parse_args()
    rows = []
    for size, (programs, block) in SIZES.items():
        start = torch.randn(programs * block, device="cuda")
        reference = None
        for variant, (mode, pdl) in VARIANTS.items():
            us, result = timed(programs, block, mode, pdl, start)
            reference = result if reference is None else reference
            rows.append({"size": size, "programs": programs, "elements": programs * block, "variant": variant,
                         "us_per_kernel": us, "equal_to_plain": bool(torch.equal(result, reference))})
            print(json.dumps(rows[-1]), flush=True)
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "kernels_per_graph": K}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
