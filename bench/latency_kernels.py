"""Latency-bound kernels of the v4-mini batch-1 decode step: each changed launch, former vs new.

    PYTHONPATH=. python bench/latency_kernels.py                  # one H200, < 3 min: $OUT/latency-kernels-h200.json
    PYTHONPATH=. python bench/latency_kernels.py --smoke --out /tmp/latency-kernels.json   # CPU interpreter, tiny

The H200 graph profile of the v4-mini batch-1 static decode step at 4K (s9, PDL off) showed three
launches slow for their work; each is timed here in its former and its new launch shape, at the
step's shapes (bf16):

* `rope` of the indexer q, x [1, 64, 128] with [1, 1, 32] tables: "former" one program of 64 rows
  (`launch_rope(min_programs=1)`), "new" 32 programs of 2 rows (`rope`).
* `select_topk` of one CSA query row, top-512 of 1024 entries (4K) and of 8192 (32K): "former"
  1 bit of θ per counting pass (32 passes, `launch_select_topk(radix_bits=1)`), "new" 4 bits (8
  passes, `select_topk`); 2 and 8 bits for reference.
* `sparse_attention` of one decode query, 32 heads x 512 (CSA: window 128 + top-512 = 640 keys,
  10 chunks; HCA at 4K: 128 + 32 = 160 keys): the partial pass + the chunk merge, "former" one
  chunk per merge step (`Tiles.combine_chunks=1`), "new" up to 16 (the op's decode tiles).

Each cell is a CUDA graph of `--calls` back-to-back calls of the op (new outputs each call, as in
the step), replayed `--reps` times; µs per call = median replay / calls. PDL off (the profile's
attribution mode) and on (the shipped default). Every variant's output is checked: RoPE and top-k
bit for bit against the reference and each other, attention within bf16 tolerance of the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for folder in (REPO, REPO / "bench"):  # dspark, and provenance beside this script (also when imported by path)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from provenance import git_commit  # noqa: E402

FULL = dict(dtype=torch.bfloat16, rope=((1, 64, 128), (1, 1, 32)), select=((1024, 512), (8192, 512)),
            attention=dict(heads=32, head_dim=512, window=128, cases={"csa_4k": 512, "hca_4k": 32}))
SMOKE = dict(dtype=torch.float32, rope=((1, 8, 24), (1, 1, 4)), select=((40, 16), (70, 9)),
             attention=dict(heads=4, head_dim=32, window=16, cases={"csa": 112, "hca": 8}))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ.get("OUT", "bench/results")) / "latency-kernels-h200.json"
    p.add_argument("--out", default=str(default_out))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the script")
    p.add_argument("--calls", type=int, default=24, help="calls of the op per captured graph")
    p.add_argument("--reps", type=int, default=30, help="graph replays timed (median)")
    return p.parse_args(argv)


def rope_cells(cfg: dict, device, g) -> list[tuple]:
    """(op, case, variants {name: fn}, check(outputs) -> dict) of the indexer q RoPE."""
    from dspark.kernels import rope

    x_shape, table_shape = cfg["rope"]
    x = torch.randn(x_shape, generator=g, device=device).to(cfg["dtype"])
    angles = torch.rand(table_shape, generator=g, device=device) * 4096
    cos, sin = angles.cos(), angles.sin()
    variants = {"former": lambda: rope.launch_rope(x, cos, sin, min_programs=1), "new": lambda: rope.rope(x, cos, sin)}
    ref = rope.rope_ref(x, cos, sin)

    def check(outs: dict) -> dict:
        return {"equal_ref": {k: bool(torch.equal(v, ref)) for k, v in outs.items()},
                "former_equals_new": bool(torch.equal(outs["former"], outs["new"]))}

    return [("rope", f"x{list(x_shape)}", variants, check)]


def select_cells(cfg: dict, device, g) -> list[tuple]:
    from dspark.kernels import indexer

    cells = []
    for n_keys, topk in cfg["select"]:
        scores = torch.randn(1, n_keys, generator=g, device=device)
        variants = {name: (lambda bits=bits, scores=scores, topk=topk:
                           indexer.launch_select_topk(scores, topk, None, None, bits))
                    for name, bits in (("former", 1), ("new", indexer.RADIX_BITS), ("radix2", 2), ("radix8", 8))}
        ref = indexer.select_topk_ref(scores, topk)

        def check(outs: dict, ref=ref) -> dict:
            return {"equal_ref": {k: bool(torch.equal(v, ref)) for k, v in outs.items()}}

        cells.append(("select_topk", f"T{n_keys}_k{topk}", variants, check))
    return cells


def attention_cells(cfg: dict, device, g) -> list[tuple]:
    """One decode query; the new tiles are the ones `sparse_attention` picks for it (checked)."""
    from dspark.kernels import attention

    a = cfg["attention"]
    heads, head_dim, window = a["heads"], a["head_dim"], a["window"]
    tiles = dataclasses.replace(attention.default_tiles(heads, head_dim), min_chunk_tiles=2)  # the op's n_q = 1 tiles
    cells = []
    for case, n_picks in a["cases"].items():
        pool = torch.randn(window + 4 * n_picks, head_dim, generator=g, device=device).to(cfg["dtype"])
        picks = torch.randperm(4 * n_picks, generator=g, device=device)[:n_picks].sort().values + window
        index = torch.cat((torch.arange(window, device=device), picks))[None]  # [1, W + K]
        q = torch.randn(1, heads, head_dim, generator=g, device=device).to(cfg["dtype"])
        sink = torch.randn(heads, generator=g, device=device)
        args = (q, pool, index, sink, head_dim ** -0.5)
        variants = {"former": lambda args=args: attention.launch_sparse_attention(
                        *args, dataclasses.replace(tiles, combine_chunks=1)),
                    "new": lambda args=args: attention.launch_sparse_attention(*args, tiles)}
        ref = attention.sparse_attention_ref(*args).float()

        def check(outs: dict, ref=ref, args=args) -> dict:
            err = {k: ((v.float() - ref).norm() / ref.norm()).item() for k, v in outs.items()}
            return {"rel_err_ref": err, "op_is_new": bool(torch.equal(attention.sparse_attention(*args), outs["new"])),
                    "max_abs_former_new": (outs["former"].float() - outs["new"].float()).abs().max().item()}

        cells.append(("sparse_attention", f"{case}_keys{index.shape[1]}", variants, check))
    return cells


def time_call(fn, device, calls: int, reps: int) -> float:
    """µs per call: CUDA graph of `calls` calls, median replay / calls; on CPU one timed call."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from bench.graph_timing import capture, replay_seconds

    graph = capture(lambda: [fn() for _ in range(calls)])
    return replay_seconds(graph, reps) / calls * 1e6


def run_cells(cells: list[tuple], device, pdl: bool, args) -> list[dict]:
    from dspark.kernels import triton_compat

    triton_compat.PDL = pdl
    rows = []
    for op, case, variants, check in cells:
        row = {"op": op, "case": case, "pdl": pdl, "us": {}}
        try:
            outs = {name: fn() for name, fn in variants.items()}
            row.update(check(outs))
            for name, fn in variants.items():
                row["us"][name] = time_call(fn, device, args.calls, args.reps)
            row["speedup"] = row["us"]["former"] / row["us"]["new"]
        except Exception as e:  # one failing cell must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def conditions(device, args) -> dict:
    info = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "calls": args.calls,
            "reps": args.reps, "smoke": args.smoke, "timing": "CUDA graph of `calls` calls, median replay / calls"}
    info["commit"] = git_commit()
    if device.type == "cuda":
        import triton

        info.update(gpu=torch.cuda.get_device_name(device), triton=triton.__version__, cuda=torch.version.cuda)
    return info


def interpreter_setup() -> None:
    """--smoke: TRITON_INTERPRET before the kernel modules are imported, and the kernel tests'
    patches of the interpreter's gaps (loop bounds under NumPy >= 2.4; tests/kernels/conftest.py)."""
    import importlib.util

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.runtime import interpreter

    if getattr(interpreter, "_dspark_patched", False):  # under pytest: the conftest ran already
        return
    spec = importlib.util.spec_from_file_location("_kernel_test_setup", REPO / "tests" / "kernels" / "conftest.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def bench_device(smoke: bool, script: str) -> torch.device | None:
    """The device of a kernel bench: the CPU under the interpreter with --smoke (set up here), else
    CUDA; None, after saying so, when there is no GPU."""
    if smoke:
        interpreter_setup()
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return None
    return torch.device("cuda")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bench_device(args.smoke, "bench/latency_kernels.py")
    if device is None:
        return 2
    from dspark.kernels import triton_compat

    cfg = SMOKE if args.smoke else FULL
    start = time.time()
    cond = conditions(device, args)
    print(json.dumps(cond), flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    shipped_pdl = triton_compat.PDL
    rows = []
    with torch.inference_mode():
        cells = rope_cells(cfg, device, g) + select_cells(cfg, device, g) + attention_cells(cfg, device, g)
        try:
            for pdl in ((False,) if args.smoke else (False, True)):
                rows += run_cells(cells, device, pdl, args)
        finally:
            triton_compat.PDL = shipped_pdl
    summary = [f"{r['op']:17s} {r['case']:18s} pdl={int(r['pdl'])} former {r['us']['former']:7.2f} us  new "
               f"{r['us']['new']:7.2f} us  x{r['speedup']:.2f}" for r in rows if "error" not in r]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "results": rows, "summary": summary}, indent=1) + "\n")
    print("\n".join(summary))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - start:.0f} s)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
