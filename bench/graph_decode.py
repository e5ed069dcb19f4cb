"""Decode step time of the V4 target: dynamic path vs the static step (eager) vs its CUDA-graph replay.

    PYTHONPATH=. python bench/graph_decode.py                      # one H200, v4-mini bf16, < 4 min
    PYTHONPATH=. python bench/graph_decode.py --config v41-mini    # the V4.1 analogue (StaticDecoderV41)
    PYTHONPATH=. python bench/graph_decode.py --smoke --out /tmp/graph-decode.json   # CPU, tiny-v4
    PYTHONPATH=. python bench/graph_decode.py --smoke --config tiny-v41              # CPU, tiny-v41

Writes JSON to --out (default $OUT/graph-decode.json; `--config` other than v4-mini / tiny-v4:
graph-decode-<config>.json). Conditions: v4-mini or v41-mini (random weights, bf16,
`KernelConfig.for_device("cuda")`; V4.1: Engram tables on the device, cache QAT on), B ∈ {1, 8, 64}
requests, one decode token each (`--tokens T`: T, a verify block), context 4096; every request's decode
state is fabricated at the context (`engine_h200.fabricate_state`: random values of the shapes a prefill leaves), then loaded
into a static bucket (`StaticDecoder`, V4.1: `StaticDecoderV41`) of B slots with capacity
context + 64. Per cell, median ms of `steps` steps (CUDA synchronised around each) of

  (a) dynamic: `model(ids, states, [1] * B)` then `truncate` back (so every step sees the context);
  (b) static eager: `StaticDecoder.step` at the same start (a rollback of one token every step);
  (c) graph: `StepGraph.replay` of (b), captured before the requests were loaded.

Also the largest |logit| difference of (b) and (c) against (a) on the first step's tokens, and the
batch-1 % of the HBM roofline (active bytes of one token, `engine_h200.active_bytes`, / 4.4 TB/s).
The smoke run (tiny-v4 or tiny-v41, fp32, torch references, no graph) checks the script on the CPU.

`--gemv-ab [LABELS]` adds, per cell, graphs captured with one of `linear`'s, `grouped_wo_a`'s or
`moe_decode`'s launch rules changed (GEMV_VARIANTS, all or the labels given: torch's matmul on the K = 512
weights, other GEMV tiles, `wo_a`'s split kernel, the multi-row GEMV off, the decode MoE's GEMV gate/up
kernel), timed in turn with the shipped graph (three rounds, medians): a rule's worth
in the step itself, where PDL and the weight prefetch hide what an op timed alone pays. `--bounds`
(V4) adds graphs captured without the compressors' pooling or updates: wrong logits, an upper bound on
what a change there can save.

`--profile` adds, per cell, where the step's time goes: `torch.profiler` over `steps` calls of the
graph replay (CPU: the eager static step), kernel time summed per kernel name (top 25 by time, with
calls per step), the summed kernel time per step against the wall time per step (what is left is
idle device time: launch gaps), the kernel launches per step, and which functions dispatch the
step's torch ops (`op_sites`: one eager static step under a dispatch mode; views left out).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_h200's fabrication and byte count

import dspark  # noqa: E402
from dspark.configs import NAMES, load_config  # noqa: E402
from dspark.engine.graphs import StepGraph  # noqa: E402
from dspark.kernels import KernelConfig  # noqa: E402
from dspark.kernels.registry import NOT_YET_ON_GPU, OPS  # noqa: E402
from dspark.models.deepseek_v4.side_stream import MAX_LANES  # noqa: E402
from dspark.models.deepseek_v4.static_state import StaticShape  # noqa: E402
from dspark.models.deepseek_v4.static_step import StaticDecoder  # noqa: E402
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM  # noqa: E402
from dspark.models.deepseek_v41.static_step import StaticDecoderV41  # noqa: E402
from engine_h200 import (HBM_BYTES_PER_S, _device_name, _token_map, active_bytes,  # noqa: E402
                         fabricate_state)
from provenance import git_commit  # noqa: E402

FULL = dict(config="v4-mini", requests=(1, 8, 64), context=4096, warmup=3, steps=20)
SMOKE = dict(config="tiny-v4", requests=(1, 2), context=40, warmup=1, steps=3)
HEADROOM = 64  # capacity beyond the context: the positions a run could still decode


def timed(fn, device, warmup: int, steps: int) -> float:
    """Median ms of `steps` calls of fn() after `warmup` untimed ones, synchronised around each."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def kernel_profile(fn, device, steps: int, top: int = 25) -> dict:
    """Device time per kernel name over `steps` calls of fn() (after one untimed call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall_us = (time.perf_counter() - t) * 1e6 / steps
    kernels = {}
    for event in prof.events():
        on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if device.type == "cuda" and not on_device:
            continue
        if device.type != "cuda" and (event.cpu_parent is not None):
            continue  # CPU: top-level ops only
        dur = event.time_range.elapsed_us() if hasattr(event, "time_range") else 0.0
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += dur
    rows = sorted(({"name": name[:160], "calls_per_step": n / steps, "us_per_step": us / steps}
                   for name, (n, us) in kernels.items()), key=lambda r: -r["us_per_step"])
    busy = sum(r["us_per_step"] for r in rows)
    return {"steps": steps, "wall_us_per_step": wall_us, "kernel_us_per_step": busy,
            "launches_per_step": sum(r["calls_per_step"] for r in rows),
            "busy_fraction": busy / wall_us if wall_us else None, "top": rows[:top]}


# Ops that only make views, metadata or uninitialised allocations (no kernel): left out of `op_sites`'
# counts (`empty_like` was counted until the sixth session's profiles: 59 of their 530 "ops" per step).
VIEW_OPS = {"view", "_unsafe_view", "expand", "t", "unsqueeze", "squeeze", "reshape", "select", "slice",
            "as_strided", "transpose", "permute", "alias", "split", "unbind", "split_with_sizes", "flatten",
            "chunk", "narrow", "unflatten", "detach", "empty", "empty_like", "empty_strided", "view_as_real",
            "_reshape_alias"}


def op_sites(fn, top: int = 40) -> dict:
    """The torch ops one call of fn() dispatches (views left out: each of the rest is about one kernel
    launch), by the innermost `dspark/` function on the Python stack (a `TorchDispatchMode`, so it
    works on any device; Triton launches are not torch ops and are not counted)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sites = collections.Counter()
            self.ops = collections.defaultdict(collections.Counter)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in VIEW_OPS:
                frames = [f for f in traceback.extract_stack()[:-1] if "/dspark/" in f.filename]
                site = (f"{frames[-1].filename.split('/dspark/')[-1]}:{frames[-1].name}" if frames else "(outside)")
                self.sites[site] += 1
                self.ops[site][name] += 1
            return func(*args, **(kwargs or {}))

    fn()
    counter = Count()
    with counter:
        fn()
    rows = [{"site": site, "ops": n, "top_ops": dict(counter.ops[site].most_common(5))}
            for site, n in counter.sites.most_common(top)]
    return {"torch_ops_per_step": sum(counter.sites.values()), "top": rows}


@contextlib.contextmanager
def captured_with(variant: dict):
    """`linear`'s and `grouped_wo_a`'s launch rules as `variant` has them while a step is captured (they
    are read then), restored after. Its keys:

    * "SHORT_K", "SHORT_K_MAX_ROWS", "GEMV_MAX_ROWS" replace `linear`'s (SHORT_K -1: torch's matmul on the
      K = 512 weights, v4-mini's `wq_b` and indexer `wq_b`, as shipped before the thirty-eighth session);
    * "tiles" (BLOCK_N, warps) replaces `gemv_tiles`' choice on the K = 512 rows (16 rows, 8 warps);
    * "GEMV_K_TILE" replaces `linear`'s (2048: rows of more than 1024 in 2048-wide K tiles at every row count);
    * "Q_NORM_FOLD" replaces `attention`'s (True: V4's per-head q norm and RoPE inside the attention's partial
      kernel, one launch fewer per layer);
    * "ROPE_EPILOGUE" replaces `linear`'s (True: the indexers' queries rotated in their GEMV's epilogue, one
      launch instead of the GEMV and the rope kernel);
    * "HEAD_WEIGHTS_EARLY" replaces `side_stream`'s (True: a CSA layer's indexer head weights on the KV lane
      before it waits for c_q);
    * "WO_A_GEMV_ROWS" replaces `grouped_wo_a.GEMV_ROWS` (0: the split kernel and its sum at every row count);
    * "UP_TMA" replaces `moe_decode.UP_TMA` (None: the decode MoE's GEMV gate/up kernel, as before the
      thirty-ninth session); "DOWN_TMA" replaces `moe_decode.DOWN_TMA` ({}: the GEMV down kernel everywhere,
      as before the fortieth session); "MOE_LATE" withholds the MoE layers' `x_ready` and the router's early
      release (`moe_route_decode.RELEASE_FIRST`): every gate/up program waits for the router, as before the
      forty-first session;
    * `BOUND_VARIANTS`' keys leave work out of V4's step (wrong logits: bounds on what a change there can
      save): "NO_POOL" every compressor's pooling (`Compressor.pool_rows`), "NO_COMPRESS" every
      compressor update (`static_step.update_compressor`: projections and pooling)."""
    from dspark.kernels import attention, grouped_wo_a, linear, moe_decode, moe_route_decode
    from dspark.models.deepseek_v4 import side_stream, static_step as v4_step
    from dspark.models.deepseek_v4.compressor import Compressor

    names = ("SHORT_K", "SHORT_K_MAX_ROWS", "GEMV_MAX_ROWS", "GEMV_K_TILE", "ROPE_EPILOGUE", "gemv_tiles")
    saved = {name: getattr(linear, name) for name in names}
    saved_wo_a, saved_update, saved_pool = grouped_wo_a.GEMV_ROWS, v4_step.update_compressor, Compressor.pool_rows
    saved_up, saved_down, saved_experts = moe_decode.UP_TMA, moe_decode.DOWN_TMA, moe_decode.decode_experts
    grouped_wo_a.GEMV_ROWS = variant.get("WO_A_GEMV_ROWS", saved_wo_a)
    saved_release, saved_early = moe_route_decode.RELEASE_FIRST, side_stream.HEAD_WEIGHTS_EARLY
    side_stream.HEAD_WEIGHTS_EARLY = variant.get("HEAD_WEIGHTS_EARLY", saved_early)
    saved_fold = attention.Q_NORM_FOLD
    attention.Q_NORM_FOLD = variant.get("Q_NORM_FOLD", saved_fold)
    if variant.get("MOE_LATE"):
        moe_decode.decode_experts = lambda *args, x_ready=False, **kwargs: saved_experts(*args, **kwargs)
        moe_route_decode.RELEASE_FIRST = False
    moe_decode.UP_TMA = variant.get("UP_TMA", saved_up)
    moe_decode.DOWN_TMA = variant.get("DOWN_TMA", saved_down)
    if variant.get("NO_COMPRESS"):
        v4_step.update_compressor = lambda *args, **kwargs: None
    if variant.get("NO_POOL"):
        Compressor.pool_rows = lambda self, *args, **kwargs: None

    def tiles(n_out, n_in, n_sms, rows=1):
        shipped = saved["gemv_tiles"](n_out, n_in, n_sms, rows)
        if "tiles" in variant and n_in == saved["SHORT_K"]:
            return variant["tiles"][0], n_in, variant["tiles"][1]
        return shipped

    for name in names[:-1]:
        setattr(linear, name, variant.get(name, saved[name]))
    if "tiles" in variant:
        linear.gemv_tiles = tiles
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(linear, name, value)
        grouped_wo_a.GEMV_ROWS, v4_step.update_compressor, Compressor.pool_rows = saved_wo_a, saved_update, saved_pool
        moe_decode.UP_TMA, moe_decode.DOWN_TMA, moe_decode.decode_experts = saved_up, saved_down, saved_experts
        moe_route_decode.RELEASE_FIRST, side_stream.HEAD_WEIGHTS_EARLY = saved_release, saved_early
        attention.Q_NORM_FOLD = saved_fold


# --gemv-ab: label -> `captured_with`'s variant. The thirty-eighth session's first run (gemv-ab-*-s38.json) was
# the other way round, before the rule shipped: the shipped graph then ran torch's matmul on these weights,
# its "gemv" variant `gemv_tiles`' shape and "gemv_n32" / "gemv_n8" the tiles below. Its part d
# (lrn-ab-*-s38.json) ran with `linear_rms_norm` (bc55aed) in the tree and a variant "q_norm_apart" that
# captured the attentions with their `q_lora_op` set to None (wq_a and q_norm as two launches again).
# Parts b, d and e also had "rows4" (SHORT_K_MAX_ROWS 4: lost at 4 rows). Part f ran at 2790aa1, where
# linear's SHORT_K_TILE made (8, 4) the shipped tiles, with a variant "gemv_n16" = the (16, 8) tiles. The
# forty-fifth session's first run (one-k-tile-*-h100-s45-*.json) had "one_k_tile": one-row launches only on
# rows of 1025-4096 in one K tile (BLOCK_K = K, the grid and warps of the 1024-wide tiles).
GEMV_VARIANTS = {"cublas": dict(SHORT_K=-1), "gemv_n8": dict(tiles=(8, 4)), "wo_a_split": dict(WO_A_GEMV_ROWS=0),
                 "gemv_one_row": dict(GEMV_MAX_ROWS=1), "k_tile_2048": dict(GEMV_K_TILE=2048),
                 "head_weights_early": dict(HEAD_WEIGHTS_EARLY=True), "rope_epilogue": dict(ROPE_EPILOGUE=True),
                 "q_norm_fold": dict(Q_NORM_FOLD=True),
                 "moe_up_gemv": dict(UP_TMA=None), "moe_down_gemv": dict(DOWN_TMA={}), "moe_late": dict(MOE_LATE=True)}
# --bounds (V4 only): label -> `captured_with`'s variant that leaves work out (the logits are then wrong)
BOUND_VARIANTS = {"no_pool": dict(NO_POOL=True), "no_compress": dict(NO_COMPRESS=True)}


def _labels(text: str) -> tuple:
    """`--gemv-ab`'s comma list -> GEMV_VARIANTS labels (a SystemExit naming an unknown one)."""
    labels = tuple(label for label in text.split(",") if label)
    unknown = sorted(set(labels) - set(GEMV_VARIANTS))
    if unknown:
        raise SystemExit(f"--gemv-ab: unknown {unknown}; known {sorted(GEMV_VARIANTS)}")
    return labels


def timed_in_turn(replays: dict, device, args: dict, rounds: int = 3) -> dict:
    """label -> median ms of `rounds` `timed` runs of each replay, the labels taken in turn every round."""
    times = {label: [] for label in replays}
    for _ in range(rounds):
        for label, replay in replays.items():
            times[label].append(timed(replay, device, args["warmup"], args["steps"]))
    return {label: statistics.median(t) for label, t in times.items()}


def cell(model, n_req: int, args: dict, graphs: bool, g: torch.Generator, profile: bool = False,
         side_ab: bool = False, gemv_ab: tuple = (), bounds: bool = False) -> dict:
    """The three timings (graph: when `graphs`) for n_req requests at the context; with `side_ab` also
    the graphs of decoders with 3, 2, 1 and 0 side streams (`side_streams=`; the third lane carries
    V4.1's mHC mixes) over the same state, timed in turn; with `gemv_ab` the graphs captured under
    `captured_with` (the GEMV_VARIANTS labelled in `gemv_ab`; with `bounds` BOUND_VARIANTS too) and the shipped
    one, timed in turn."""
    device, context = model.device, args["context"]
    n_tok = args["tokens"]
    shape = StaticShape(slots=n_req, max_context=context + HEADROOM, tokens=n_tok)
    family = StaticDecoderV41 if isinstance(model, DeepseekV41ForCausalLM) else StaticDecoder
    decoder = family(model, shape)
    graph = StepGraph(decoder, n_tok) if graphs else None  # before loading: its warm-up writes every slot
    # --side-ab: decoders with 3, 2, 1 and 0 side streams (`StaticDecoder(side_streams=)`) besides the default one
    lane_counts = tuple(range(MAX_LANES, -1, -1)) if graphs and side_ab else ()
    others = {lanes: family(model, shape, side_streams=lanes) for lanes in lane_counts}
    other_graphs = {lanes: StepGraph(other, n_tok) for lanes, other in others.items()}
    variant_graphs = {}
    variants = {**{label: GEMV_VARIANTS[label] for label in gemv_ab}, **(BOUND_VARIANTS if bounds else {})}
    for label, variant in (variants.items() if graphs else ()):
        with captured_with(variant):
            others[label] = family(model, shape)
            variant_graphs[label] = StepGraph(others[label], n_tok)
    vocab, token_map = model.config.vocab_size, _token_map(model)
    states = [fabricate_state(model.new_state(), context, g, vocab, token_map) for _ in range(n_req)]
    for slot, state in enumerate(states):
        decoder.load(slot, state)
        for other in others.values():
            other.load(slot, state)
    ids_host = torch.randint(0, model.config.vocab_size, (n_req, n_tok), generator=torch.Generator().manual_seed(n_req))
    ids, starts = decoder.plan(ids_host, [context] * n_req)
    flat = ids.reshape(-1)

    def dynamic():
        out = model(flat, states, [n_tok] * n_req).logits
        for state in states:
            state.truncate(context)
        return out

    reference = dynamic().view(n_req, n_tok, -1)
    row = {"requests": n_req, "context": context, "tokens": n_tok,
           "static_max_abs_diff": (decoder.step(ids, starts) - reference).abs().max().item(),
           "dynamic_ms": timed(dynamic, device, args["warmup"], args["steps"]),
           "static_eager_ms": timed(lambda: decoder.step(ids, starts), device, args["warmup"], args["steps"])}
    if graph is not None:
        row["graph_max_abs_diff"] = (graph.replay(ids, starts) - reference).abs().max().item()
        row["graph_ms"] = timed(graph.replay, device, args["warmup"], args["steps"])
    if other_graphs:  # three rounds over (3, 2, 1, 0 side streams), each graph's time the median of its three
        reference_graph = graph.replay(ids, starts).clone()
        row["side_lanes_equal"] = all(torch.equal(g_.replay(ids, starts), reference_graph)
                                      for g_ in other_graphs.values())
        times = timed_in_turn({lanes: g_.replay for lanes, g_ in other_graphs.items()}, device, args)
        for lanes in other_graphs:
            row[f"graph_ms_{lanes}_side_streams"] = times[lanes]
        row["side_streams_speedup"] = row["graph_ms_0_side_streams"] / row[f"graph_ms_{MAX_LANES}_side_streams"]
        row["mix_lane_speedup"] = row["graph_ms_2_side_streams"] / row["graph_ms_3_side_streams"]
    if variant_graphs:  # the shipped graph and each variant's in turn, three rounds
        row["gemv_max_abs_diff"] = {label: (g_.replay(ids, starts) - reference).abs().max().item()
                                    for label, g_ in variant_graphs.items()}
        times = timed_in_turn({"shipped": graph.replay, **{k: g_.replay for k, g_ in variant_graphs.items()}},
                              device, args)
        row["gemv_ab_ms"] = times
        row["gemv_ab_speedup"] = {label: times["shipped"] / times[label] for label in variant_graphs}
    if profile:
        target = graph.replay if graph is not None else (lambda: decoder.step(ids, starts))
        row["profile"] = kernel_profile(target, device, args["steps"])
        row["profile"]["of"] = "graph replay" if graph is not None else "static eager step"
        row["op_sites"] = op_sites(lambda: decoder.step(ids, starts))
    for key in ("dynamic", "static_eager", "graph"):
        if f"{key}_ms" in row:
            row[f"{key}_tok_s_total"] = n_req / (row[f"{key}_ms"] / 1e3)  # steps: one committed token each
    print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "op_sites")}), flush=True)
    if profile:
        summary = {k: v for k, v in row["profile"].items() if k != "top"}
        print(json.dumps({"profile": summary, "top": [(r["name"][:60], round(r["us_per_step"], 1), r["calls_per_step"])
                                                       for r in row["profile"]["top"][:12]]}), flush=True)
        sites = row["op_sites"]
        print(json.dumps({"torch_ops_per_step": sites["torch_ops_per_step"],
                          "sites": [(r["site"][-60:], r["ops"]) for r in sites["top"][:30]]}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny-v4 on the CPU, torch references, no graph")
    ap.add_argument("--config", default=None,
                    help="shipped config (default v4-mini; smoke tiny-v4): v41-mini / tiny-v41 for the V4.1 target")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/graph-decode.json)")
    ap.add_argument("--profile", action="store_true",
                    help="add each cell's kernel-time breakdown (with --no-pdl for per-kernel attribution: with "
                         "PDL a kernel's time includes its wait for the one before)")
    ap.add_argument("--requests", default=None, help="comma list of request counts (default 1,8,64; smoke 1,2)")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 4096; smoke 40)")
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens per request per step (default 1; 4 = a DSpark budget-3 verify block)")
    ap.add_argument("--not-yet", action="store_true",
                    help="also run the kernels of registry.NOT_YET_ON_GPU (their first GPU timing)")
    ap.add_argument("--triton", default="",
                    help="comma list of registry ops to run on Triton (e.g. one of registry.NOT_YET_ON_GPU)")
    ap.add_argument("--ref", default="",
                    help="comma list of registry ops held on their torch references (A/B of a kernel against "
                         "the path it replaced)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch every Triton kernel without programmatic dependent launch (A/B of PDL)")
    ap.add_argument("--side-ab", action="store_true",
                    help="also time the graphs of decoders with 3, 2, 1 and 0 side streams "
                         "(StaticDecoder(side_streams=)), in turn")
    ap.add_argument("--gemv-ab", nargs="?", const=",".join(GEMV_VARIANTS), default="",
                    help="also time graphs captured with one of linear's, grouped_wo_a's or moe_decode's launch rules "
                         "changed (captured_with, GEMV_VARIANTS; a comma list of their labels, default all) against "
                         "the shipped graph, in turn")
    ap.add_argument("--bounds", action="store_true",
                    help="V4: also time graphs captured without the compressors' pooling / updates (BOUND_VARIANTS: "
                         "wrong logits; what a change there could save at most), in turn with the shipped graph")
    ap.add_argument("--image-token-id", type=int, default=None,
                    help="V4.1 configs: set image_token_id (as the released checkpoint does): the gates then select "
                         "with a per-token bias (`moe_route_rows`, or the module with `--ref moe_route_rows`), Engram skips that id")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="no weight prefetch before the PDL wait (triton_compat.pdl_prefetch; A/B of it)")
    ap.add_argument("--fold-max-tokens", type=int, default=None,
                    help="V4: fold the sublayer norm into the mHC sites (row epilogue) up to this many rows "
                         "(mhc_norm.FOLD_MAX_TOKENS and ROW_MAX_TOKENS; shipped 4 and 16)")
    cli = ap.parse_args()
    from dspark.kernels import mhc_norm, triton_compat

    # this bench process only: the module constants every launch consults
    triton_compat.PDL, triton_compat.PREFETCH = not cli.no_pdl, not cli.no_prefetch
    if cli.fold_max_tokens is not None:
        if cli.fold_max_tokens < 1:
            raise ValueError(f"--fold-max-tokens must be positive, got {cli.fold_max_tokens}")
        mhc_norm.FOLD_MAX_TOKENS = mhc_norm.ROW_MAX_TOKENS = cli.fold_max_tokens
    args = dict(SMOKE if cli.smoke else FULL)
    if cli.config:
        if cli.config not in NAMES:
            raise ValueError(f"--config {cli.config!r} is not a shipped config {NAMES}")
        args["config"] = cli.config
    name = "graph-decode.json" if args["config"] in ("v4-mini", "tiny-v4") else f"graph-decode-{args['config']}.json"
    out = cli.out or os.path.join(os.environ.get("OUT", "."), name)
    if cli.requests:
        requests = tuple(int(n) for n in cli.requests.split(","))
        if not requests or min(requests) < 1:
            raise ValueError(f"--requests must list positive counts, got {cli.requests!r}")
        args["requests"] = requests
    if cli.context is not None:
        if cli.context < 1:
            raise ValueError(f"--context must be positive, got {cli.context}")
        args["context"] = cli.context
    if cli.tokens < 1:
        raise ValueError(f"--tokens must be positive, got {cli.tokens}")
    args["tokens"] = cli.tokens
    device = torch.device("cpu" if cli.smoke else "cuda")
    dtype = torch.float32 if cli.smoke else torch.bfloat16
    config = load_config(args["config"])
    if cli.image_token_id is not None:
        if config.get("model_type") != "deepseek_v41":
            raise ValueError(f"--image-token-id needs a V4.1 config, got {args['config']!r}")
        config["image_token_id"] = cli.image_token_id
    # V4.1: a static step gathers Engram rows on the device (host tables are rejected).
    options = {"engram_tables": "device"} if config.get("model_type") == "deepseek_v41" else {}
    kernels = KernelConfig.for_device(device)
    if cli.not_yet and device.type == "cuda":
        kernels = dataclasses.replace(kernels, **{op: "triton" for op in NOT_YET_ON_GPU})
    for flag, impl in (("triton", "triton"), ("ref", "ref")):
        chosen = [op for op in getattr(cli, flag).split(",") if op]
        if any(op not in OPS for op in chosen):
            raise ValueError(f"--{flag} {getattr(cli, flag)!r}: each op must be a registry op {OPS}")
        if chosen and device.type == "cuda":
            kernels = dataclasses.replace(kernels, **{op: impl for op in chosen})
    model = dspark.init_model(config, seed=0, device=device, dtype=dtype, kernels=kernels, **options)
    g = torch.Generator(device=device).manual_seed(0)
    roofline = active_bytes(model, args["context"])
    results = {"conditions": {"device": _device_name(device), "torch": torch.__version__, "config": args["config"],
                              "dtype": str(dtype), "weights": "random", "kernels": str(model.kernels),
                              "commit": git_commit(), "smoke": cli.smoke, "pdl": not cli.no_pdl, "prefetch": not cli.no_prefetch, **options,
                              "cache_qat": getattr(model, "cache_qat", None), "decode_tokens_per_step": args["tokens"],
                              "static_capacity": args["context"] + HEADROOM, "grid": args,
                              "image_token_id": cli.image_token_id, "fold_max_tokens": mhc_norm.FOLD_MAX_TOKENS,
                              "row_max_tokens": mhc_norm.ROW_MAX_TOKENS,
                              "decode_state": "fabricated at the context (random values, prefill shapes)",
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
               "roofline": roofline, "cells": []}
    with torch.no_grad():
        for n_req in args["requests"]:
            results["cells"].append(cell(model, n_req, args, graphs=not cli.smoke, g=g, profile=cli.profile,
                                         side_ab=cli.side_ab, gemv_ab=_labels(cli.gemv_ab),
                                         bounds=cli.bounds))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    b1 = results["cells"][0]
    results["batch1_pct_of_hbm_roofline"] = {
        key: 100 * roofline["roofline_s"] / (b1[f"{key}_ms"] / 1e3)
        for key in ("dynamic", "static_eager", "graph") if f"{key}_ms" in b1}
    results["hbm_bytes_per_s"] = HBM_BYTES_PER_S
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results["batch1_pct_of_hbm_roofline"]), flush=True)


if __name__ == "__main__":
    main()
