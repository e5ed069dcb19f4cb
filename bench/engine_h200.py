"""The batched engine on one GPU: decode step time vs load and speculation mode, prefill throughput,
the HF transformers peer and the batch-1 HBM roofline, on v4-mini (random weights, bf16).

    PYTHONPATH=. python bench/engine_h200.py --out $OUT/engine-h200.json            # one H200, < 8 min
    PYTHONPATH=. python bench/engine_h200.py --smoke --out /tmp/engine-smoke.json    # CPU, tiny config, ~1 min
    PYTHONPATH=. python bench/engine_h200.py --static-decode --out $OUT/engine-h200-static.json  # graphs
    PYTHONPATH=. python bench/engine_h200.py --static-decode --overlap --requests 1,8,64 --contexts 4096 \
        --modes none,dspark1,dspark2,dspark3,auto,auto_async --decode-only --steps 8 --confidence 0.8629 \
        --table-from-cells --budget-s 300 --out $OUT/engine-h200-auto-ahead.json   # auto vs budgets 1..3

What it measures (issue 7; seeds' conditions):

* decode: requests R ∈ {1, 8, 16, 32, 64, 128, 256} × mode ∈ {none, mtp1, dspark3, auto} at contexts
  4K and 32K. Every request's decode state (target and drafter) is *fabricated* at the context
  length: random tensors of exactly the shapes a prefill of that length leaves (window latents,
  compressor rows, compressed entries, indexer keys, token ids; DSpark's last-W context keys, the
  MTP block's window and pending streams), not a real prefill (the smoke run checks the shapes
  against a real prefill). A cell is `warmup` untimed then `steps` timed `Engine.step()` calls over
  R injected requests (CUDA synchronised around each step); its step time is the median. Then
  `steps` more back to back with one sync at the end (`step_ms_pipelined`: how a server runs it,
  and the timing in which `--overlap` can hide the host's work behind the device's).
  Weights are random, so the measured acceptance is meaningless: tokens/s are converted at
  `TAU` committed tokens per step, as the seeds do (3.25 for 3 verified drafts; MTP-1 at its
  ceiling of 2, flagged), next to the measured tokens/step. "auto" is the synchronous planner
  (Algorithm 1) over a capacity table profiled here at the same context (width 4); "auto_async"
  the asynchronous planner (budget from confidences two rounds old, spec §4.3), which needs no
  host sync on the current round's confidences before the verify call; with `--overlap` its greedy
  rounds keep a round in flight at one budget per round (`planner.uniform_budget`; budget 0 is a plain
  step that still feeds the drafter), "auto" (Algorithm 1) runs synchronously. `--modes` also takes
  dspark1 and dspark2 (fixed budgets 1 and 2, not in the default grid), and dspark3_t1 /
  dspark3_t1_eager: budget 3 with every request sampled at T = 1, drafting from the sampled propose
  graphs / eagerly (those graphs dropped).
* `--confidence C`: the DSpark drafter's confidence head answers C at every position (a constant
  logit, bench only), and every cell is converted at the matching geometric model instead of `TAU`: a
  round that verifies ℓ drafts commits Σ_{k<=ℓ} C^k tokens, summed over each step's measured ℓ_r.
  The planners then see exactly the acceptance the conversion credits (C = 0.8629 gives budget 3 its
  3.25), so "auto vs the best fixed budget" measures the planner and its overlap, not random noise.
* `--table-from-cells`: the auto cells plan with a capacity table built from the fixed cells of the
  same load and context (none, dspark1..3: B = R(1 + n) tokens, their pipelined step time), i.e. the
  static step's own SPS, instead of the dynamic-path table profiled at the start of the context. The
  'none' cell (B = R) prices auto_async's plain rounds (a little low: it has no drafter to observe), so
  list none in `--modes` with auto_async.
* prefill: one target forward of N ∈ {4K, 8K, 16K, 32K, 64K} new tokens over a fabricated context
  of 128K − N tokens (so the call ends at 128K), tokens/s = N / time; OOM is recorded, not fatal.
* peer: HF transformers' `DeepseekV4ForCausalLM` (eager) on the same config at batch 1, greedy
  `generate` of 32 tokens after a 512-token prompt; our figure for the ratio is the batch-1
  no-speculation decode at 4K context (a longer context than the peer's: conservative).
* roofline: active bytes of one batch-1 decode token (every weight a token touches, routed experts
  at top-k / E, plus the decode state it reads at 4K) / 4.4 TB/s, against the measured step.

The grid is trimmed to fit `--budget-s` (default 450 s): a cell whose predicted time (from the
previous cell of the same mode) would overrun its phase's share is skipped and listed in
`skipped` with the reason. By default decoding runs the dynamic path (per-request loop, no CUDA
graphs); `--static-decode` runs every decode cell with `EngineConfig(static_decode=True)`: R static
slots whose context holds the cell's steps, one CUDA graph per verify width captured when the cell's
engine is built (not in the step time; `engine_build_s` in the row), the fabricated states loaded into the slots at
the first (warm-up) step. The DSpark cells (dspark3, auto, auto_async) then also draft on the static drafter over the
same slots (`dspark.engine.static_draft`: greedy propose and observe as CUDA graphs; `static_drafter` and
`draft_graphs` in the row), and so does MTP-1 (`dspark.engine.static_mtp_draft`; since the fourteenth
session its rounds run in flight under `--overlap` too, at its fixed budget). Prefill and the peer are
unchanged by the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch

import dspark
from dspark.configs import load_config
from dspark.draft import DSparkDrafter, MtpDrafter
from dspark.draft.context import DSparkState
from dspark.draft.mtp import MtpState
from dspark.engine import Engine, EngineConfig
from dspark.kernels import KernelConfig
from dspark.kernels.registry import NOT_YET_ON_GPU
from dspark.models.deepseek_v41.state import DecodeStateV41
from dspark.profile import split_tokens, time_step
from dspark.request import Request
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from provenance import git_commit

HBM_BYTES_PER_S = 4.4e12  # measured H200 copy bandwidth (bench/README.md)
# dspark1 / dspark2 at the geometric model that gives budget 3 its 3.25 (per-draft survival 0.8629)
TAU = {"none": 1.0, "mtp1": 2.0, "dspark1": 1.863, "dspark2": 2.607, "dspark3": 3.25, "auto": 3.25,
       "auto_async": 3.25, "dspark3_t1": 3.25, "dspark3_t1_eager": 3.25}
MODES = ("none", "mtp1", "dspark1", "dspark2", "dspark3", "auto", "auto_async", "dspark3_t1",
         "dspark3_t1_eager")  # the order cells run in
DEFAULT_MODES = ("none", "mtp1", "dspark3", "auto", "auto_async")
BUDGET = {"none": 0, "mtp1": 1, "dspark1": 1, "dspark2": 2, "dspark3": 3, "auto": "auto", "auto_async": "auto",
          "dspark3_t1": 3, "dspark3_t1_eager": 3}
# Sampled cells: every request at temperature 1 (synchronous rounds: the propose's q is read before the
# verify); "_eager" drops the static drafter's sampled graphs, so its rounds draft eagerly as before them.
SAMPLED = {"dspark3_t1": True, "dspark3_t1_eager": False}
PROFILE_STEPS = 3  # --profile: steps per profile (after one untimed step)
FIXED_DSPARK = ("none", "dspark1", "dspark2", "dspark3")  # the cells a table from the cells is built on
FULL = dict(config="v4-mini", requests=(1, 8, 16, 32, 64, 128, 256), contexts=(4096, 32768),
            prefill=(4096, 8192, 16384, 32768, 65536), prefill_context=131072, warmup=1, steps=3,
            hf_prompt=512, hf_new=32, capacity_probes=(1, 4, 16, 64, 256, 1024))
SMOKE = dict(config="tiny-v4", requests=(1, 4), contexts=(40, 100), prefill=(16, 32), prefill_context=128,
             warmup=1, steps=2, hf_prompt=16, hf_new=4, capacity_probes=(1, 4, 16))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -------------------------------------------------------------------------------------------------
# Fabricated decode state
# -------------------------------------------------------------------------------------------------


def fabricate_state(state, context: int, g: torch.Generator, vocab: int, token_map: torch.Tensor | None = None):
    """Fill an empty V4 or V4.1 decode state as if `context` tokens had been fed: the rows a prefill
    keeps, with random values (RoPE'd, normalised values would differ only numerically).
    `token_map`: a V4.1 target's Engram token map (its `engram_token_map`), for the n-gram history."""
    device = state.token_ids.device
    ids = torch.randint(0, vocab, (context,), generator=g, device=device)
    if isinstance(state, DecodeStateV41):
        state.end_step(ids, None if state.ngram is None else token_map[ids])
        for source in state.sources.values():
            kv, gate = source.rows()
            if source.pooled:
                source.rows_start = source.live_from(context)
                n = context - source.rows_start
                source.append_rows(_randn((n, kv.shape[-1]), kv.dtype, device, g), _randn((n, gate.shape[-1]), gate.dtype, device, g))
            entries, keys = source.entries(), source.index_keys()
            n_e = context // source.rate
            source.append_entries(_randn((n_e, entries.shape[-1]), entries.dtype, device, g),
                                  _randn((n_e, keys.shape[-1]), keys.dtype, device, g))
    else:
        state.end_step(ids)
    for layer in state.layers:
        w = layer.window
        w.start = max(0, context - (w.window - 1))
        w.append(_randn((context - w.start, w.latents().shape[-1]), w.latents().dtype, device, g))
        for part in (layer.compressor, layer.indexer):
            if part is None:
                continue
            kv, score = part.rows()
            part.rows_start = part.live_from(context)
            n = context - part.rows_start
            part.append_rows(_randn((n, kv.shape[-1]), kv.dtype, device, g),
                             _randn((n, score.shape[-1]), score.dtype, device, g))
            part.append_entries(_randn((context // part.rate, part.head_dim), kv.dtype, device, g))
    state.rewind_floor = context
    return state


def _token_map(model) -> torch.Tensor | None:
    return getattr(model, "engram_token_map", None)


def _randn(shape, dtype, device, g):
    """Random values made on the device itself (`g` is a generator of that device): fabricating
    hundreds of 32K-token states must not go through host memory."""
    return torch.randn(shape, generator=g, device=device).to(dtype)


def fabricate_drafter_state(drafter, context: int, g: torch.Generator, vocab: int):
    if drafter is None:
        return None
    dstate = drafter.new_state()
    if isinstance(dstate, DSparkState):
        m = drafter.model
        dstate.length = context
        dstate.latents = [_randn((min(context, drafter.window), m.head_dim), m.dtype, m.device, g)
                          for _ in dstate.latents]
        return dstate
    if isinstance(dstate, MtpState):
        t = drafter.target
        # a prefill of `context` rows pairs the first context − 1 (X_t, tok_{t+1}); X_{context−1} waits
        fabricate_state(dstate.state, context - 1, g, vocab)
        dstate.pending = _randn((t.config.hc_mult, t.config.hidden_size), t.dtype, t.device, g)
        return dstate
    raise ValueError(f"cannot fabricate a state for {type(drafter).__name__}")


def check_fabrication(model, drafter, context: int) -> dict:
    """Shapes of a fabricated state equal those of a real prefill of `context` tokens (smoke check)."""
    g = torch.Generator(device=model.device).manual_seed(0)
    real, fake = model.new_state(), fabricate_state(model.new_state(), context, g, model.config.vocab_size, _token_map(model))
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (context,), generator=g, device=model.device), [real], [context])
    a, b = real.snapshot(live_only=True), fake.snapshot(live_only=True)  # what the next call reads
    shape = lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else v  # noqa: E731
    bad = [k for k in a if shape(a[k]) != shape(b.get(k))]
    if bad:
        raise RuntimeError(f"fabricated state differs from a real prefill at {bad[:5]}")
    return {"context": context, "keys_checked": len(a)}


def inject(engine: Engine, model, drafter, requests: int, context: int, g: torch.Generator,
           params: SamplingParams = SamplingParams()) -> None:
    """Put `requests` decoding requests with fabricated state straight into the engine's running set."""
    vocab = model.config.vocab_size
    prompt = [0] * context  # shared, never mutated: only its length matters to the bookkeeping
    for i in range(requests):
        # the request's generator on the model's device: sampled verification draws its noise there
        req = Request(prompt, fabricate_state(model.new_state(), context, g, vocab, _token_map(model)),
                      torch.Generator(device=model.device).manual_seed(i), 10**6, frozenset(), params,
                      request_id=f"r{i}", feed=prompt, prefilled=context)
        req.dstate = fabricate_drafter_state(drafter, context, g, vocab)
        req.out.append(int(torch.randint(0, vocab, (1,), generator=g, device=g.device)))  # the anchor
        engine.scheduler.running.append(req)


# -------------------------------------------------------------------------------------------------
# Phases
# -------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


def profile_table(model, context: int, probes, g) -> CapacityTable:
    """SPS(B) at `context` over fabricated states, width 4 (anchor + 3 drafts)."""
    lens_max = split_tokens(probes[-1], 4)
    states = [fabricate_state(model.new_state(), context, g, model.config.vocab_size, _token_map(model)) for _ in lens_max]
    samples, g = {}, torch.Generator().manual_seed(2)  # host generator for the probe ids
    with torch.inference_mode():
        for b in probes:
            lens = split_tokens(b, 4)
            time_step(model, states[:len(lens)], lens, g)
            samples[b] = [time_step(model, states[:len(lens)], lens, g) for _ in range(2)]
    return CapacityTable.from_step_times(samples, f"{_device_name(model.device)}, ctx {context}, width 4 (bench)")


class ConstantConfidence(torch.nn.Module):
    """`--confidence`: a confidence head answering the same c_k at every position (random weights give
    noise there); logits fp32 [..., γ] from hidden [..., γ, D]."""

    def __init__(self, confidence: float):
        super().__init__()
        self.logit = math.log(confidence / (1 - confidence))

    def forward(self, hidden: torch.Tensor, prev_embeddings: torch.Tensor) -> torch.Tensor:
        return torch.full(hidden.shape[:-1], self.logit, dtype=torch.float32, device=hidden.device)


def model_tau(verified: list[int], confidence: float) -> float:
    """Committed tokens of one step under the geometric model: Σ_r Σ_{k<=ℓ_r} C^k."""
    return sum((1 - confidence ** (n + 1)) / (1 - confidence) for n in verified)


def cells_table(rows: list[dict], requests: int, context: int, device) -> CapacityTable | None:
    """`--table-from-cells`: SPS at B = R(1 + n) from the pipelined step of the fixed DSpark cells (and
    none) of this load and context; None with fewer than two of them."""
    steps = {requests * (1 + BUDGET[r["mode"]]): r["step_ms_pipelined"] / 1e3 for r in rows
             if r["mode"] in FIXED_DSPARK and r["requests"] == requests and r["context"] == context}
    if len(steps) < 2:
        return None
    return CapacityTable.from_step_times({b: [t] for b, t in steps.items()},
                                         f"{_device_name(device)}, ctx {context}, {requests} requests, fixed cells")


def decode_cell(model, drafters, mode, requests, context, table, args, g) -> dict:
    drafter = drafters[mode]
    budget = BUDGET[mode]
    static = dict(static_decode=False)  # the dynamic path unless --static-decode (on CUDA the default is static)
    if args["static_decode"]:  # the slots hold the fabricated context + every step's tokens (≤ 16 each)
        # Algorithm 1 ("auto") plans on the round's own confidences: its rounds cannot be in flight
        steps = args["warmup"] + args["steps"] + (PROFILE_STEPS + 1) * bool(args.get("profile"))
        static = dict(static_decode=True, static_context=context + 16 * steps,
                      overlap=args.get("overlap", False) and mode != "auto")
    _sync(model.device)
    t = time.perf_counter()
    engine = Engine(model, EngineConfig(max_running=requests, max_prompt_tokens=context + 1, max_new_tokens=10**6,
                                        draft_tokens=budget, drafter=drafter, capacity=table,
                                        planner="async" if mode == "auto_async" else "sync", **static))
    _sync(model.device)
    capture_s = time.perf_counter() - t
    if mode in SAMPLED and not SAMPLED[mode] and engine.static_draft is not None:
        engine.static_draft.sampled_graphs = None  # the eager sampled propose of the runner
    inject(engine, model, drafter, requests, context, g,
           SamplingParams(temperature=1.0) if mode in SAMPLED else SamplingParams())
    times, committed, verified, modelled = [], [], [], []
    for i in range(args["warmup"] + args["steps"]):
        drafts_before = [r.stats.verified_tokens for r in engine.running]
        before = sum(len(r.out) for r in engine.running)
        _sync(model.device)
        t = time.perf_counter()
        engine.step()
        _sync(model.device)
        if i >= args["warmup"]:
            times.append(time.perf_counter() - t)
            committed.append(sum(len(r.out) for r in engine.running) - before)
            lens = [r.stats.verified_tokens - v for r, v in zip(engine.running, drafts_before)]  # ℓ_r
            verified.append(sum(lens))
            modelled.append(model_tau(lens, args["confidence"]) if args["confidence"] else 0.0)
    step = statistics.median(times)
    # Back to back, one sync at the end: how a server runs the engine, and the only timing in which
    # the overlap can hide the host's work for step t+1 behind the device's step t. Reading the host
    # counters between steps reads no device value.
    _sync(model.device)
    t = time.perf_counter()
    modelled_pipelined = []
    for _ in range(args["steps"]):
        drafts_before = [r.stats.verified_tokens for r in engine.running]
        engine.step()
        if args["confidence"]:
            lens = [r.stats.verified_tokens - v for r, v in zip(engine.running, drafts_before)]
            modelled_pipelined.append(model_tau(lens, args["confidence"]))
    _sync(model.device)
    pipelined = (time.perf_counter() - t) / args["steps"]
    # committed tokens per request per step: the geometric model over each timing's own steps (auto
    # may draft in one and not in the other), or TAU
    tau = sum(modelled) / len(modelled) / requests if args["confidence"] else TAU[mode]
    tau_pipelined = sum(modelled_pipelined) / len(modelled_pipelined) / requests if args["confidence"] else TAU[mode]
    drafting = engine.static_draft
    row = {"mode": mode, "requests": requests, "context": context, "static_decode": args["static_decode"],
           "static_drafter": drafting is not None, "n_draft": engine.n_draft,
           "draft_graphs": drafting is not None and bool(drafting.propose_graphs),
           "engine_build_s": capture_s, "step_ms": step * 1e3,
           "step_ms_all": [t * 1e3 for t in times], "measured_tokens_per_step_per_request": sum(committed) / len(committed) / requests,
           "mean_drafts_verified_per_request": sum(verified) / len(verified) / requests, "tau_converted": tau, "tok_s_per_user": tau / step, "tok_s_total": tau * requests / step,
           "step_ms_pipelined": pipelined * 1e3, "tau_converted_pipelined": tau_pipelined,
           "tok_s_total_pipelined": tau_pipelined * requests / pipelined}
    if mode == "mtp1":
        row["note"] = "MTP-1 converted at its ceiling of 2 tokens/step (every draft accepted)"
    if mode in ("auto", "auto_async") and not args["confidence"]:
        row["note"] = ("converted at 3.25 like budget 3; with random weights the confidences are noise, so its "
                       "verify width (mean_drafts_verified_per_request) is not what a trained drafter would get")
    if args["confidence"]:
        row["note"] = f"converted at the geometric model, constant confidence {args['confidence']}"
    if mode in ("auto", "auto_async"):
        row["capacity_label"] = table.label
        row["round_in_flight"] = engine.draft_ahead is not None
    if args.get("profile"):
        from graph_decode import kernel_profile  # here: graph_decode imports this module

        row["kernel_profile"] = kernel_profile(engine.step, model.device, PROFILE_STEPS)
        row["host_profile"] = host_profile(engine.step, PROFILE_STEPS)
    for r in list(engine.running):
        engine.abort(r.request_id)
    return row


def host_profile(fn, steps: int, top: int = 25) -> dict:
    """Where the host's time goes in `steps` calls of fn() (cProfile, after one untimed call): the
    functions of largest own time and the `dspark/` functions of largest cumulative time, µs per call."""
    import cProfile
    import pstats

    fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)

    def rows(key, keep=lambda site: True):
        entries = sorted(((site, v) for site, v in stats.items() if keep(site)), key=lambda e: -e[1][key])
        return [{"site": f"{Path(f).name}:{line}({name})", "calls_per_step": v[0] / steps,
                 "us_per_step": v[key] * 1e6 / steps} for (f, line, name), v in entries[:top]]

    return {"steps": steps, "own": rows(2), "dspark_cumulative": rows(3, lambda site: "/dspark/" in site[0])}


def run_decode(model, drafters, args, clock, share_s, results, skipped, g):
    for context in args["contexts"]:
        phase_end = clock.left() - share_s[context]
        table = profile_table(model, context, tuple(b for b in args["capacity_probes"]
                                                    if b <= 4 * max(args["requests"])), g)
        results["capacity"][str(context)] = table.to_dict()
        last: dict[str, tuple[int, float]] = {}
        for requests in args["requests"]:
            for mode in args["modes"]:
                cell_table = table
                if mode in ("auto", "auto_async") and args["table_from_cells"]:
                    cell_table = cells_table(results["decode"], requests, context, model.device) or table
                if mode not in drafters:
                    skipped.append({"phase": "decode", "mode": mode, "requests": requests, "context": context,
                                    "why": "drafter unavailable"})
                    continue
                if mode in last:  # predict from the previous load: step time grows at most linearly in R
                    r0, t0 = last[mode]
                    predicted = t0 * requests / r0 * (args["warmup"] + args["steps"]) + 2.0
                    if clock.left() - predicted < phase_end:
                        skipped.append({"phase": "decode", "mode": mode, "requests": requests, "context": context,
                                        "why": f"predicted {predicted:.0f} s exceeds the time left for this phase"})
                        continue
                try:
                    row = decode_cell(model, drafters, mode, requests, context, cell_table, args, g)
                except torch.OutOfMemoryError as e:
                    skipped.append({"phase": "decode", "mode": mode, "requests": requests, "context": context,
                                    "why": f"out of memory: {str(e)[:160]}"})
                    _free()
                    continue
                last[mode] = (requests, row["step_ms"] / 1e3)
                results["decode"].append(row)
                print(json.dumps(row), flush=True)
        _free()


def run_prefill(model, args, clock, results, skipped, g):
    with torch.inference_mode():  # warm the kernels once at a small size, so the first probe is not the cold one
        time_step(model, [fabricate_state(model.new_state(), 1024, g, model.config.vocab_size, _token_map(model))], [256],
                  torch.Generator().manual_seed(0), rewind=False)
    for n in args["prefill"]:
        ctx = args["prefill_context"] - n
        if results["prefill"] and clock.left() < 3 * results["prefill"][-1]["seconds"] * n / results["prefill"][-1]["new_tokens"] + 5:
            skipped.append({"phase": "prefill", "new_tokens": n, "why": "not enough time left"})
            continue
        try:
            state = fabricate_state(model.new_state(), ctx, g, model.config.vocab_size, _token_map(model))
            with torch.inference_mode():
                seconds = time_step(model, [state], [n], torch.Generator().manual_seed(n), rewind=False)
            row = {"new_tokens": n, "context_before": ctx, "context_after": ctx + n, "seconds": seconds,
                   "tok_s": n / seconds, "note": "one target forward (first call at this size; kernels warmed at 256 tokens)"}
            results["prefill"].append(row)
            print(json.dumps(row), flush=True)
        except torch.OutOfMemoryError as e:
            skipped.append({"phase": "prefill", "new_tokens": n, "why": f"out of memory: {str(e)[:160]}"})
        finally:
            state = None
            _free()


def run_peer(config: dict, args, device, results):
    """HF transformers' DeepSeek-V4 generate at batch 1; records why when it cannot run."""
    try:
        import transformers
    except ImportError as e:
        results["peer"] = {"available": False, "why": f"transformers not importable: {e}"}
        return
    if config.get("model_type") != "deepseek_v4":
        results["peer"] = {"available": False, "transformers": transformers.__version__,
                           "why": f"transformers has no class for model_type {config.get('model_type')!r}"}
        return
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        results["peer"] = {"available": False, "transformers": transformers.__version__,
                           "why": "this transformers has no DeepseekV4ForCausalLM"}
        return
    try:
        hf_config = transformers.DeepseekV4Config(**{k: v for k, v in config.items() if k != "architectures"})
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        with torch.device(device):
            hf = transformers.DeepseekV4ForCausalLM._from_config(hf_config, dtype=dtype).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config["vocab_size"], (1, args["hf_prompt"]), generator=g).to(device)
        gen = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
            walls = {}
            for new in (1, args["hf_new"]):
                _sync(device)
                t = time.perf_counter()
                hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **gen)
                _sync(device)
                walls[new] = time.perf_counter() - t
        decode_s = (walls[args["hf_new"]] - walls[1]) / (args["hf_new"] - 1)
        results["peer"] = {"available": True, "transformers": transformers.__version__, "class": "DeepseekV4ForCausalLM",
                           "attn_implementation": getattr(hf.config, "_attn_implementation", None), "prompt": args["hf_prompt"], "new_tokens": args["hf_new"],
                           "wall_s": walls[args["hf_new"]], "tok_s_wall": args["hf_new"] / walls[args["hf_new"]],
                           "decode_s_per_token": decode_s, "tok_s_decode": 1 / decode_s}
        del hf
    except Exception as e:  # any failure of the peer is a result to record, not a crash of the bench
        results["peer"] = {"available": False, "transformers": transformers.__version__,
                           "why": f"{type(e).__name__}: {str(e)[:300]}"}
    _free()


def active_bytes(model, context: int) -> dict:
    """Bytes one batch-1 decode token must read: weights it touches + the decode state it reads."""
    c, item = model.config, model.dtype.itemsize
    routed = shared = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or "engram" in name:  # Engram: a few table rows per token, not the tables
            continue
        if ".ffn.experts." in name:
            routed += p.numel() * p.element_size()
        else:
            shared += p.numel() * p.element_size()
    embed = model.embed.weight
    shared -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()  # one embedding row
    weights = shared + routed * c.num_experts_per_tok / c.n_routed_experts
    state = _state_bytes(c, context, item) if hasattr(c, "layer_roles") else 0
    for t in getattr(c, "layer_types", ()):  # window + (top-k or all) compressed entries + all indexer keys (scored)
        state += c.sliding_window * c.head_dim * item
        if t == "compressed_sparse_attention":
            rate = c.compress_rates[t]
            state += min(c.index_topk, context // rate) * c.head_dim * item
            state += context // rate * c.index_head_dim * item
        elif t == "heavily_compressed_attention":
            state += context // c.compress_rates[t] * c.head_dim * item
    total = weights + state
    return {"weight_bytes": weights, "state_bytes": state, "total_bytes": total,
            "roofline_s": total / HBM_BYTES_PER_S, "hbm_bytes_per_s": HBM_BYTES_PER_S, "context": context}


def _state_bytes(c, context: int, item: int) -> int:
    """V4.1: decode state one token reads: each layer's window, then the entries of its KV source
    (the top-k of them where the layer reads an index source's list, else all) and, on an index
    source, every index key it scores."""
    state = 0
    for role in c.layer_roles:
        state += c.sliding_window * c.head_dim * item
        if role.ratio == 0:
            continue
        entries = context // role.ratio
        state += (min(c.index_topk, entries) if role.index_source is not None else entries) * c.head_dim * item
        if role.index_source == role.layer_id:
            state += entries * c.index_head_dim * item
    return state


def _free():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# -------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU, tiny grid: checks the script")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 450, smoke 120)")
    ap.add_argument("--static-decode", action="store_true",
                    help="decode cells on EngineConfig(static_decode=True): static slots, CUDA graphs on CUDA")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed Engine.step() calls per decode cell (default 3, smoke 2); more make the "
                         "auto vs fixed-budget comparison less noisy")
    ap.add_argument("--config", default=None,
                    help="shipped config name (default v4-mini; smoke tiny-v4), e.g. v41-mini for the V4.1 analogue")
    ap.add_argument("--overlap", action="store_true",
                    help="with --static-decode: EngineConfig(overlap=True), one plain greedy step in flight")
    ap.add_argument("--requests", default=None, help="comma list: the decode grid's request counts")
    ap.add_argument("--modes", default=None, help=f"comma list of decode modes, run in the order {','.join(MODES)} "
                                                   f"(default {','.join(DEFAULT_MODES)})")
    ap.add_argument("--confidence", type=float, default=None,
                    help="constant DSpark confidence C in (0, 1) and the geometric conversion at C (module docstring)")
    ap.add_argument("--table-from-cells", action="store_true",
                    help="auto cells plan with SPS from the fixed cells (none, dspark1..3) of their load and context")
    ap.add_argument("--contexts", default=None, help="comma list of decode contexts (default 4096,32768)")
    ap.add_argument("--decode-only", action="store_true", help="skip the HF peer and the prefill phase")
    ap.add_argument("--peer", action="store_true", help="with --decode-only: still run the HF peer (batch 1)")
    ap.add_argument("--profile", action="store_true",
                    help=f"per decode cell, {PROFILE_STEPS} more steps under torch.profiler (device kernels) and "
                         "cProfile (host functions)")
    ap.add_argument("--not-yet", action="store_true",
                    help="also run the kernels of registry.NOT_YET_ON_GPU (their first GPU timing)")
    cli = ap.parse_args()
    args = dict(SMOKE if cli.smoke else FULL)
    for name, parse in (("requests", int), ("contexts", int), ("modes", str)):
        value = getattr(cli, name)
        if value is not None:
            items = tuple(parse(v) for v in value.split(","))
            if name == "modes" and not set(items) <= set(MODES):
                raise ValueError(f"--modes {value!r}: each must be one of {MODES}")
            if name != "modes" and (not items or min(items) < 1):
                raise ValueError(f"--{name} must list positive ints, got {value!r}")
            args[name] = tuple(sorted(items, key=MODES.index)) if name == "modes" else items
    args.setdefault("modes", DEFAULT_MODES)
    if cli.confidence is not None and not 0 < cli.confidence < 1:
        raise ValueError(f"--confidence must lie in (0, 1), got {cli.confidence}")
    args["confidence"] = cli.confidence
    args["table_from_cells"] = cli.table_from_cells
    auto_modes = {"auto", "auto_async"} & set(args["modes"])
    if cli.table_from_cells and auto_modes and not set(FIXED_DSPARK) <= set(args["modes"]):
        # With fewer points the table interpolates the missing budgets' SPS linearly, which is far
        # too kind at large loads (H200, 256 requests, none + dspark3 only: auto planned budget 1 at
        # an interpolated 14 ms per step that took 20 ms, 0.72 of plain decoding)
        raise ValueError(f"--table-from-cells with {sorted(auto_modes)} needs every fixed cell in --modes: "
                         f"{','.join(FIXED_DSPARK)}")
    if cli.config:
        args["config"] = cli.config
    if cli.steps is not None:
        if cli.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {cli.steps}")
        args["steps"] = cli.steps
    args["static_decode"] = cli.static_decode
    if cli.overlap and not cli.static_decode:
        raise ValueError("--overlap needs --static-decode")
    args["overlap"] = cli.overlap
    args["profile"] = cli.profile
    budget = cli.budget_s or (120.0 if cli.smoke else 450.0)
    device = torch.device("cpu" if cli.smoke else "cuda")
    clock = Clock(budget)
    torch.manual_seed(0)
    g = torch.Generator(device=device).manual_seed(0)
    config = load_config(args["config"])
    dtype = torch.float32 if cli.smoke else torch.bfloat16
    kernels = KernelConfig.for_device(device)
    if cli.not_yet and device.type == "cuda":
        kernels = dataclasses.replace(kernels, **{op: "triton" for op in NOT_YET_ON_GPU})
    model = dspark.init_model(config, seed=0, device=device, dtype=dtype, kernels=kernels)
    drafters = {"none": None, "dspark3": DSparkDrafter(model).init_weights(1)}
    try:  # V4.1's next-token layers are DSpark stages, not an MTP block: no MTP-1 mode there
        drafters["mtp1"] = MtpDrafter(model)
    except ValueError as e:
        print(f"no MTP-1 mode: {e}", flush=True)
    if cli.confidence is not None:  # the DSpark stages' last module holds the head (dspark_v4.py)
        drafters["dspark3"].model.mtp[-1].confidence_head = ConstantConfidence(cli.confidence)
    for mode in ("dspark1", "dspark2", "auto", "auto_async", *SAMPLED):
        drafters[mode] = drafters["dspark3"]
    results = {
        "conditions": {"device": _device_name(device), "torch": torch.__version__, "config": args["config"],
                       "dtype": str(dtype), "weights": "random", "commit": git_commit(), "smoke": cli.smoke,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "budget_s": budget, "kernels": str(model.kernels),
                       "graphs": cli.static_decode and device.type == "cuda", "static_decode": cli.static_decode,
                       "decode_state": "fabricated at the context length (random values, prefill shapes), not prefilled",
                       "tau_conversion": (f"geometric, constant confidence {cli.confidence}" if cli.confidence
                                          else TAU), "dspark_gamma": drafters["dspark3"].block_size,
                       "grid": {k: v for k, v in args.items() if k != "config"}},
        "decode": [], "prefill": [], "capacity": {}, "skipped": [],
    }
    if cli.smoke:
        results["fabrication_check"] = [check_fabrication(model, None, n) for n in (37, 64)]
    results["roofline"] = active_bytes(model, args["contexts"][0])
    # each context's decode phase gets this share of the budget (the rest: 32K decode, peer and prefill)
    keep = {args["contexts"][0]: 0.45 * budget, args["contexts"][-1]: 0.2 * budget}
    if cli.decode_only:  # nothing after the decode grid: each context's phase gets an equal share
        keep = {ctx: 0.95 * budget / len(args["contexts"]) for ctx in args["contexts"]}
    def save():  # after every phase, so a run cut short still leaves what it measured
        summarise(results, args)
        results["elapsed_s"] = budget - clock.left()
        with open(cli.out, "w") as f:
            json.dump(results, f, indent=1)

    run_decode(model, drafters, args, clock, keep, results, results["skipped"], g)
    save()
    if cli.decode_only and cli.peer:
        run_peer(config, args, device, results)
        save()
    if not cli.decode_only:
        run_peer(config, args, device, results)
        save()
        run_prefill(model, args, clock, results, results["skipped"], g)
        save()
    print(json.dumps(results["summary"], indent=1))


def summarise(results: dict, args: dict) -> None:
    rows = {(r["mode"], r["requests"], r["context"]): r for r in results["decode"]}
    c0 = args["contexts"][0]
    s = {}
    b1 = rows.get(("none", 1, c0))
    if b1:
        roof = results["roofline"]["roofline_s"]
        s["batch1_step_ms"] = b1["step_ms"]
        s["batch1_pct_of_hbm_roofline"] = 100 * roof / (b1["step_ms"] / 1e3)
        peer = results.get("peer", {})
        if peer.get("available"):
            s["ratio_vs_hf_decode"] = b1["tok_s_per_user"] / peer["tok_s_decode"]
            s["ratio_vs_hf_wall"] = b1["tok_s_per_user"] / peer["tok_s_wall"]
            # The ratio a step at the HBM roofline would reach against this peer: a ratio target above
            # it cannot be met by plain batch-1 decoding whatever the kernels (the 160x was set
            # against a peer at 8.3 tok/s, where it is 53 % of the roofline).
            s["ratio_vs_hf_at_roofline"] = 1.0 / roof / peer["tok_s_decode"]
    for ctx in args["contexts"]:
        for r in args["requests"]:
            base, dsp = rows.get(("none", r, ctx)), rows.get(("dspark3", r, ctx))
            if base and dsp:
                s.setdefault("dspark3_over_none_total", {})[f"{r}@{ctx}"] = dsp["tok_s_total"] / base["tok_s_total"]
            fixed = [rows[(m, r, ctx)] for m in ("none", "mtp1", "dspark1", "dspark2", "dspark3") if (m, r, ctx) in rows]
            for mode in ("auto", "auto_async"):
                auto = rows.get((mode, r, ctx))
                for timing in ("tok_s_total", "tok_s_total_pipelined"):
                    if auto and fixed:
                        best = max(fixed, key=lambda row: row[timing])
                        suffix = "" if timing == "tok_s_total" else "_pipelined"
                        s.setdefault(f"{mode}_over_best_fixed{suffix}", {})[f"{r}@{ctx}"] = auto[timing] / best[timing]
                        s.setdefault(f"best_fixed{suffix}", {})[f"{r}@{ctx}"] = best["mode"]
    s["skipped_cells"] = len(results["skipped"])
    results["summary"] = s


if __name__ == "__main__":
    main()
