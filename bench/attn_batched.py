"""Batched decode attention on one GPU: all requests of a step in ONE sparse-attention launch, and the
whole-model decode step with the batched attention vs the old per-request loop.

    PYTHONPATH=. python bench/attn_batched.py --out $OUT/attn-batched.json     # one H200, ~3 min
    PYTHONPATH=. python bench/attn_batched.py --smoke --out /tmp/attn.json      # CPU: checks the script

1. `attn_decode_batched`: B ∈ {1, 8, 64, 128} requests, each decoding one token at the end of its
   own 32K-token context, served by one `sparse_attention` call over one pool that stacks every
   request's window (128 latents) and compressed entries: HCA keys = window + all 256 entries
   (rate 128), CSA keys = window + 512 of 8192 entries (rate 4, random distinct picks); head_dim
   512, bf16, v4-mini (32 heads) and V4-Flash (64 heads). Timed with `triton.testing.do_bench`
   (L2 flushed before each run, median); `per_request_us` times the old layout (B launches, one
   per request) the same way; `graph_us` the one launch replayed from a CUDA graph (L2 flushed by a
   captured 256 MB read, timed alone and subtracted; a write until the forty-second session): the op
   without its launch overhead. bytes = the key rows the queries touch (each once) + q + out + index;
   GB/s = bytes / time; % of the 4.4 TB/s H200 copy bandwidth.
2. `model_decode`: v4-mini (`dspark/configs/v4-mini.json`) with random bf16 weights and the fused
   kernels; B ∈ {1, 8, 64} requests with decode state fabricated at 4K and 32K tokens
   (`bench/engine_h200.py::fabricate_state`); median wall time of `--steps` greedy decode steps
   (CUDA-synchronised, host included) after 2 warm-up steps, with the batched attention (`new`) and
   with every layer's `forward_per_request` (`old`); `rel_err` compares the first step's logits.
3. `attn_tiles`: the CSA case at B = 8 and 128 under the fused kernel's alternative launch shapes
   (`SWEEP`: program order, prefetching the next key tile, 32-key tiles, more key chunks), to pick
   the default from measurements.
4. `attn_flashinfer` (when flashinfer imports): the same cases on flashinfer's MLA kernels
   (`dspark.kernels.attention_flashinfer`; sink applied from the LSE). `plan_ms` is the host
   scheduling (one sync; once per step and key-list layout), `us` / `graph_us` the planned `run`
   (kernel + sink epilogue) as above, `kernel_graph_us` flashinfer's kernel alone in a graph.
   `graph_pct_copy` / `kernel_pct_copy`: the same as % of this card's measured device-to-device copy
   bandwidth (`copy_TBps` in the conditions), so a card other than the H200 is judged by its own.
   `graph_read_*` / `kernel_read_*`: the same two after a read flush instead of the write
   (`graph_timer`'s `flush`: no dirty L2 lines left for the op to write back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

from bench.engine_h200 import fabricate_state  # noqa: E402
from bench.graph_timing import capture, replay_seconds  # noqa: E402
from dspark.api import init_model  # noqa: E402
from dspark.kernels import KernelConfig  # noqa: E402

HBM_BYTES_PER_S = 4.4e12  # measured H200 copy bandwidth (bench/README.md)
HEAD_DIM, WINDOW, CONTEXT = 512, 128, 32768
LAYERS = {"hca": (128, None), "csa": (4, 512)}  # rate, top-k (None: every entry)
HEADS = {"v4-mini": 32, "v4-flash": 64}
FULL = dict(batches=(1, 8, 64, 128), sweep_batches=(8, 128), model_batches=(1, 8, 64), contexts=(4096, 32768),
            config="v4-mini", context=CONTEXT, heads=HEADS, steps=5)
SMOKE = dict(batches=(1, 3), sweep_batches=(3,), model_batches=(1, 3), contexts=(40,), config="tiny-v4",
             context=1024, heads={"tiny": 4}, steps=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/attn-batched.json")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, reference ops: checks the script")
    p.add_argument("--skip-model", action="store_true", help="only the attention-op cases")
    p.add_argument("--batches", help="requests per launch, comma-separated (default 1,8,64,128)")
    p.add_argument("--skip-sweep", action="store_true", help="no Triton launch-shape sweep")
    p.add_argument("--skip-per-request", action="store_true", help="no one-launch-per-request timing")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ attention op cases


def decode_inputs(batch: int, heads: int, rate: int, topk: int | None, context: int, device, g):
    """One-launch inputs for `batch` requests decoding at `context`: q [B, H, d], pool [B·(W+T), d]
    (request b: its window then its T entries), index [B, W + K], sink [H]; and the pool rows read."""
    n_entries = context // rate
    rows_per_request = WINDOW + n_entries
    pool = torch.randn(batch * rows_per_request, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    base = torch.arange(batch, device=device).unsqueeze(-1) * rows_per_request  # [B, 1]
    window = base + torch.arange(WINDOW, device=device)
    if topk is None:
        picks = torch.arange(n_entries, device=device).expand(batch, -1)
    else:
        picks = torch.rand(batch, n_entries, generator=g, device=device).argsort(-1)[:, :topk].sort(-1).values
    index = torch.cat((window, base + WINDOW + picks), dim=-1)  # [B, W + K]
    q = torch.randn(batch, heads, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g, device=device)
    return q, pool, index, sink, rows_per_request


def decode_cases(cfg: dict, device):
    """(layer, kind, B, heads, `decode_inputs`) of every case, inputs drawn from one seeded generator."""
    g = torch.Generator(device=device).manual_seed(0)
    for name, heads in cfg["heads"].items():
        for kind, (rate, topk) in LAYERS.items():
            for batch in cfg["batches"]:
                yield name, kind, batch, heads, decode_inputs(batch, heads, rate, topk, cfg["context"], device, g)


def attention_rows(cfg: dict, device, timer, per_request_timing: bool = True) -> list[dict]:
    from dspark.kernels import get_op

    impl = "triton" if device.type == "cuda" else "ref"
    attend = get_op(KernelConfig(sparse_attention=impl), "sparse_attention")
    ref = get_op(KernelConfig(), "sparse_attention")
    scale = HEAD_DIM**-0.5
    rows = []
    for name, kind, batch, heads, (q, pool, index, sink, per) in decode_cases(cfg, device):
        out = attend(q, pool, index, sink, scale)
        check = slice(0, min(batch, 8))
        expected = ref(q[check], pool, index[check], sink, scale).float()
        err = ((out[check].float() - expected).norm() / expected.norm()).item()
        fused_s = timer(lambda: attend(q, pool, index, sink, scale))

        local = index - torch.arange(batch, device=device).unsqueeze(-1) * per  # rows of its own slice

        def per_request():  # the old layout: one launch per request over its own pool slice
            for b in range(batch):
                attend(q[b : b + 1], pool[b * per : (b + 1) * per], local[b : b + 1], sink, scale)

        per_request_s = timer(per_request) if per_request_timing else float("nan")
        n_bytes = (batch * index.shape[1] * HEAD_DIM * pool.element_size()  # key rows, each once
                   + 2 * q.numel() * q.element_size() + index.numel() * index.element_size())
        rows.append({"case": "attn_decode_batched", "layer": name, "kind": kind, "B": batch,
                     "keys_per_query": index.shape[1], "context": cfg["context"], "us": fused_s * 1e6,
                     "per_request_us": per_request_s * 1e6, "bytes": n_bytes,
                     "GBps": n_bytes / fused_s / 1e9, "pct_hbm": 100 * n_bytes / fused_s / HBM_BYTES_PER_S,
                     "rel_err": err})
        r = rows[-1]
        if device.type == "cuda":  # the op as a captured graph runs it: no launch overhead
            graph_s = graph_timer(lambda: attend(q, pool, index, sink, scale))
            r.update(graph_us=graph_s * 1e6, graph_pct_hbm=100 * n_bytes / graph_s / HBM_BYTES_PER_S)
            print(f"  in a CUDA graph: {r['graph_us']:.1f} us ({r['graph_pct_hbm']:.1f}% HBM)", flush=True)
        print(f"{name} {kind} B={batch}: {r['us']:.1f} us ({r['GBps']:.0f} GB/s, {r['pct_hbm']:.1f}% HBM; "
              f"per-request launches {r['per_request_us']:.1f} us), rel err {err:.1e}", flush=True)
        del q, pool, index, local
    return rows


def gpu_timer(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3  # median, L2 flushed, seconds


FLUSHES = ("write", "read")


def graph_timer(fn, reps: int = 50, flush: str = "read") -> float:
    """Seconds per call of fn() replayed from a CUDA graph, L2 flushed first: a graph of (flush, fn) and
    one of the flush alone are each replayed `reps` times (CUDA events around each replay, median) and
    the second is subtracted. What the op costs once the launches are captured, as in the graph-captured
    decode step. `flush`:

    * "write" zeroes a 256 MB buffer (as `triton.testing.do_bench` does). That leaves the L2 (50 MB on
      the H100, 60 on the H200) full of dirty lines, which fn's own reads then evict: fn pays for
      writing them back, and the flush alone, timed without fn, does not.
    * "read" (the default since the forty-second session) reads a 256 MB buffer (a max over it). Earlier
      dirty lines are written back during the flush, and fn starts from an L2 of clean lines that are
      not its own, as in a decode step, whose earlier kernels read weights and write only small
      activations. On one H100 (`bench/l2_flush.py`, l2-flush-h100-s42.json) the write flush added
      about 7 µs to every op it preceded: issue 6's one-token MoE ops 1.08-1.10× slower, 1.02× at 8
      tokens, 1.004× at 64.
    """
    if flush not in FLUSHES:
        raise ValueError(f"graph_timer flush must be one of {FLUSHES}, got {flush!r}")
    buf = torch.zeros(256 << 20, dtype=torch.int8, device="cuda")
    clear = buf.zero_ if flush == "write" else buf.max
    both = capture(lambda: (clear(), fn()))
    alone = capture(clear)
    return max(replay_seconds(both, reps) - replay_seconds(alone, reps), 1e-9)


def cpu_timer(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flashinfer_rows(cfg: dict, device, copy_bps: float) -> list[dict]:
    """`attn_flashinfer`: the `attention_rows` cases on flashinfer's MLA kernels (module docstring)."""
    from dspark.kernels.attention_flashinfer import SparseAttentionFlashinfer
    from dspark.kernels.attention_ref import sparse_attention_ref

    scale = HEAD_DIM**-0.5
    rows = []
    for name, kind, batch, heads, (q, pool, index, sink, _) in decode_cases(cfg, device):
        op = SparseAttentionFlashinfer()
        try:
            out = op(q, pool, index, sink, scale)  # compiles on the first call
            sync(device)
            start = time.perf_counter()
            op.plan(index, heads, scale, q.dtype)
            plan_s = time.perf_counter() - start
            check = slice(0, min(batch, 8))
            expected = sparse_attention_ref(q[check], pool, index[check], sink, scale).float()
            err = ((out[check].float() - expected).norm() / expected.norm()).item()
            run_s = gpu_timer(lambda: op.run(q, pool, sink))
            parts = {"graph": lambda: op.run(q, pool, sink), "kernel": lambda: op.kernel(q, pool)}
            graph_s, kernel_s = (graph_timer(fn, flush="write") for fn in parts.values())  # as measured before
            # the same after a read flush (graph_timer: no dirty L2 lines left for the op to write back)
            read_s = {part: graph_timer(fn, flush="read") for part, fn in parts.items()}
        except Exception as exc:  # no nvcc, a shape flashinfer rejects: record, go on
            rows.append({"case": "attn_flashinfer", "layer": name, "kind": kind, "B": batch,
                         "error": repr(exc)[:400]})
            print(f"flashinfer {name} {kind} B={batch}: {rows[-1]['error']}", flush=True)
            continue
        n_bytes = (batch * index.shape[1] * HEAD_DIM * pool.element_size()
                   + 2 * q.numel() * q.element_size() + index.numel() * 4)
        rows.append({"case": "attn_flashinfer", "layer": name, "kind": kind, "B": batch,
                     "keys_per_query": index.shape[1], "context": cfg["context"], "plan_ms": plan_s * 1e3,
                     "us": run_s * 1e6, "graph_us": graph_s * 1e6, "kernel_graph_us": kernel_s * 1e6,
                     "bytes": n_bytes, "pct_hbm": 100 * n_bytes / run_s / HBM_BYTES_PER_S,
                     "graph_pct_hbm": 100 * n_bytes / graph_s / HBM_BYTES_PER_S,
                     "kernel_pct_hbm": 100 * n_bytes / kernel_s / HBM_BYTES_PER_S, "rel_err": err})
        r = rows[-1]
        print(f"flashinfer {name} {kind} B={batch}: run {r['us']:.1f} us, graph {r['graph_us']:.1f} us "
              f"({r['graph_pct_hbm']:.1f}% HBM), kernel {r['kernel_graph_us']:.1f} us "
              f"({r['kernel_pct_hbm']:.1f}%), plan {r['plan_ms']:.2f} ms, rel err {err:.1e}", flush=True)
        r["graph_pct_copy"] = 100 * n_bytes / graph_s / copy_bps
        r["kernel_pct_copy"] = 100 * n_bytes / kernel_s / copy_bps
        print(f"  of this card's copy bandwidth: graph {r['graph_pct_copy']:.1f}%, kernel {r['kernel_pct_copy']:.1f}%",
              flush=True)
        for part, sec in read_s.items():
            r.update({f"{part}_read_us": sec * 1e6, f"{part}_read_pct_hbm": 100 * n_bytes / sec / HBM_BYTES_PER_S,
                      f"{part}_read_pct_copy": 100 * n_bytes / sec / copy_bps})
        print(f"  after a read flush: graph {r['graph_read_us']:.1f} us ({r['graph_read_pct_hbm']:.1f}% HBM, "
              f"{r['graph_read_pct_copy']:.1f}% copy), kernel {r['kernel_read_us']:.1f} us "
              f"({r['kernel_read_pct_hbm']:.1f}% HBM)", flush=True)
        del q, pool, index
    return rows


def copy_bytes_per_s(device, n_bytes: int = 1 << 30) -> float:
    """This card's device-to-device copy bandwidth (bytes read + written per second, `gpu_timer`'s
    median): the ceiling `*_pct_copy` divides by, so that a card other than the H200 (whose 4.4 TB/s
    the `*_pct_hbm` fields assume) is measured against its own."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / gpu_timer(lambda: dst.copy_(src))


# Launch shapes of the fused kernel compared at B = 8 and 128 (CSA): each compiles for sm_90
# without register spills (checked offline); "default" is what the model runs.
SWEEP = {"default": {}, "rows_fastest": {"heads_fastest": False}, "prefetch": {"prefetch": True},
         "block_n32": {"block_n": 32}, "waves8": {"waves": 8}, "prefetch_waves8": {"prefetch": True, "waves": 8}}


def sweep_rows(cfg: dict, device, timer) -> list[dict]:
    """`attn_tiles`: the CSA decode case under each `SWEEP` launch shape (one launch, as above)."""
    import dataclasses

    from dspark.kernels import attention

    scale = HEAD_DIM**-0.5
    g = torch.Generator(device=device).manual_seed(0)
    rate, topk = LAYERS["csa"]
    rows = []
    for name, heads in cfg["heads"].items():
        for batch in cfg["sweep_batches"]:
            q, pool, index, sink, _ = decode_inputs(batch, heads, rate, topk, cfg["context"], device, g)
            ref = attention.sparse_attention_ref(q[:8], pool, index[:8], sink, scale).float()
            n_bytes = (batch * index.shape[1] * HEAD_DIM * pool.element_size()
                       + 2 * q.numel() * q.element_size() + index.numel() * index.element_size())
            for variant, changes in SWEEP.items():
                tiles = dataclasses.replace(attention.default_tiles(heads, HEAD_DIM), **changes)
                try:
                    out = attention.launch_sparse_attention(q, pool, index, sink, scale, tiles)
                    err = ((out[:8].float() - ref).norm() / ref.norm()).item()
                    t = timer(lambda: attention.launch_sparse_attention(q, pool, index, sink, scale, tiles))
                except Exception as exc:  # a shape the compiler rejects on this GPU: record, go on
                    rows.append({"case": "attn_tiles", "layer": name, "B": batch, "variant": variant,
                                 "error": repr(exc)[:300]})
                    continue
                rows.append({"case": "attn_tiles", "layer": name, "kind": "csa", "B": batch, "variant": variant,
                             "tiles": dataclasses.asdict(tiles), "us": t * 1e6, "bytes": n_bytes,
                             "GBps": n_bytes / t / 1e9, "pct_hbm": 100 * n_bytes / t / HBM_BYTES_PER_S,
                             "rel_err": err})
                print(f"tiles {name} csa B={batch} {variant}: {t * 1e6:.1f} us ({rows[-1]['pct_hbm']:.1f}% HBM), "
                      f"rel err {err:.1e}", flush=True)
            del q, pool, index
    return rows


# ------------------------------------------------------------------------------ whole-model step


def set_attention_path(model, per_request: bool) -> None:
    """Switch every attention layer between the batched `forward` and `forward_per_request`."""
    for layer in model.layers:
        if per_request:
            layer.attn.forward = layer.attn.forward_per_request
        elif "forward" in vars(layer.attn):
            del layer.attn.forward


def decode_steps(model, batch: int, context: int, steps: int, device) -> tuple[list[float], torch.Tensor]:
    """Fabricated states at `context`, 2 warm-up + `steps` timed greedy steps -> (times, first logits)."""
    g = torch.Generator(device=device).manual_seed(1)
    vocab = model.config.vocab_size
    states = [fabricate_state(model.new_state(), context, g, vocab) for _ in range(batch)]
    tokens = torch.randint(0, vocab, (batch,), generator=g, device=device)
    times, first = [], None
    for step in range(2 + steps):
        sync(device)
        start = time.perf_counter()
        logits = model(tokens, states, [1] * batch).logits
        tokens = logits.argmax(-1)
        sync(device)
        if step >= 2:
            times.append(time.perf_counter() - start)
        first = logits if first is None else first
    return times, first


def model_rows(cfg: dict, device) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = init_model(cfg["config"], seed=0, device=device, dtype=dtype)
    rows = []
    with torch.inference_mode():
        for context in cfg["contexts"]:
            for batch in cfg["model_batches"]:
                result = {}
                for path in ("new", "old"):
                    set_attention_path(model, per_request=path == "old")
                    times, logits = decode_steps(model, batch, context, cfg["steps"], device)
                    result[path] = (statistics.median(times), logits.float())
                set_attention_path(model, per_request=False)
                (new_s, new_logits), (old_s, old_logits) = result["new"], result["old"]
                err = ((new_logits - old_logits).norm() / old_logits.norm()).item()
                rows.append({"case": "model_decode", "config": cfg["config"], "B": batch, "context": context,
                             "new_ms": new_s * 1e3, "old_ms": old_s * 1e3, "speedup": old_s / new_s,
                             "new_tok_s": batch / new_s, "rel_err": err})
                print(f"model B={batch} ctx={context}: new {new_s * 1e3:.1f} ms, old {old_s * 1e3:.1f} ms "
                      f"({old_s / new_s:.2f}x), logits rel err {err:.1e}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def conditions(device) -> dict:
    info = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hbm_ceiling_TBps": HBM_BYTES_PER_S / 1e12}
    if device.type == "cuda":
        import triton

        info.update(gpu=torch.cuda.get_device_name(device), triton=triton.__version__, cuda=torch.version.cuda)
    return info


def run_setup(args, full: dict, smoke: dict, script: str) -> tuple[dict, torch.device] | None:
    """(grid, device) of a run from `--smoke` / `--batches`; None, after saying so, without a GPU."""
    cfg = dict(smoke if args.smoke else full)
    if args.batches:
        cfg["batches"] = tuple(int(b) for b in args.batches.split(","))
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return None
    return cfg, device


def main(argv=None) -> int:
    args = parse_args(argv)
    setup = run_setup(args, FULL, SMOKE, "bench/attn_batched.py")
    if setup is None:
        return 2
    cfg, device = setup
    start = time.time()
    cond = conditions(device)
    print(json.dumps(cond), flush=True)
    timer = gpu_timer if device.type == "cuda" else cpu_timer
    with torch.inference_mode():
        rows = attention_rows(cfg, device, timer, per_request_timing=not args.skip_per_request)
        if device.type == "cuda" and not args.skip_sweep:  # the Triton launch shapes (CPU check: tests/kernels)
            rows += sweep_rows(cfg, device, timer)
        if device.type == "cuda":
            from dspark.kernels.attention_flashinfer import flashinfer_available

            if flashinfer_available():
                cond["copy_TBps"] = copy_bytes_per_s(device) / 1e12
                rows += flashinfer_rows(cfg, device, cond["copy_TBps"] * 1e12)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_model:
        rows += model_rows(cfg, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "args": vars(args), "results": rows}, indent=1))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
