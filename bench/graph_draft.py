"""DSpark drafting time: the dynamic `DSparkDrafter` vs the static drafter (eager) vs its CUDA-graph replay.

    PYTHONPATH=. python bench/graph_draft.py                                   # one H200, v4-mini bf16, < 2 min
    PYTHONPATH=. python bench/graph_draft.py --smoke --out /tmp/graph-draft.json   # CPU, tiny-v4, no graph
    PYTHONPATH=. python bench/graph_draft.py --requests 64 --n-draft 3   # propose drafting 3 of the γ slots

Writes JSON to --out (default $OUT/graph-draft.json). Conditions: v4-mini target (random weights, bf16,
`KernelConfig.for_device("cuda")`) and a random DSpark drafter built as bench/engine_h200.py builds it
(`DSparkDrafter(model).init_weights(1)`: γ = 5, window 128, three stages), B ∈ {1, 8, 64} requests at
context 4096; every request's draft state is fabricated at the context (`engine_h200.
fabricate_drafter_state`: random keys of the last W positions), then loaded into a static bucket of B
slots taking γ + 1 rows per observe. Per cell, median ms of `steps` calls (CUDA synchronised around each):

  propose, greedy:   (a) dynamic `drafter.propose`  (b) static eager `StaticDrafter.propose`
                     (c) graph `ProposeGraph.replay`
  propose, T = 1:    (d) dynamic with per-request CPU generators (the generate loop's)
                     (e) static eager, counter-based noise       (f') graph `SampledProposeGraph.replay`
                     (`sampled_graph_ms`; `sampled_graph_q_max_abs_diff`: its q against (e)'s)
  observe γ + 1 rows per request (random features): (f) dynamic `drafter.observe` per request
                     (g) static eager `StaticDrafter.observe`  (h) graph `ObserveGraph.replay`

`--n-draft k` drafts only the first k slots past the backbone in every propose (dynamic `n_draft=k`,
a static drafter built for k: what an engine with `draft_tokens=k` runs); default γ.

Also the number of greedy tokens where (b) and (c) differ from (a), and the largest confidence-logit
difference. The smoke run (tiny-v4, fp32, torch references, no graph) checks the script on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_h200's fabrication

import dspark  # noqa: E402
from dspark.configs import load_config  # noqa: E402
from dspark.draft import DSparkDrafter  # noqa: E402
from dspark.draft.static_context import StaticDraftShape  # noqa: E402
from dspark.draft.static_drafter import StaticDrafter  # noqa: E402
from dspark.draft.static_graph import ObserveGraph, ProposeGraph, SampledProposeGraph  # noqa: E402
from dspark.kernels import KernelConfig  # noqa: E402
from engine_h200 import _device_name, fabricate_drafter_state  # noqa: E402
from graph_decode import kernel_profile, op_sites, timed  # noqa: E402
from provenance import git_commit  # noqa: E402

FULL = dict(config="v4-mini", requests=(1, 8, 64), context=4096, warmup=3, steps=20)
SMOKE = dict(config="tiny-v4", requests=(1, 2), context=40, warmup=1, steps=3)


def cell(drafter, n_req: int, args: dict, graphs: bool, g: torch.Generator, profile: bool = False) -> dict:
    """All timings for n_req requests at the context."""
    target, device, context = drafter.target, drafter.model.device, args["context"]
    vocab, rows, (w, s) = target.config.vocab_size, drafter.block_size + 1, (args["warmup"], args["steps"])
    static = StaticDrafter(drafter, StaticDraftShape(slots=n_req, tokens=rows), n_draft=args.get("n_draft"))
    n_draft = static.n_draft  # γ when not given
    observe_graph = ObserveGraph(static, rows) if graphs else None  # before loading: its warm-up writes
    propose_graph = ProposeGraph(static, pool=observe_graph.pool()) if graphs else None
    dstates = [fabricate_drafter_state(drafter, context, g, vocab) for _ in range(n_req)]
    for slot, dstate in enumerate(dstates):
        static.load(slot, dstate, slot)  # noise key: the slot
    anchors_host = torch.randint(0, vocab, (n_req,), generator=torch.Generator().manual_seed(n_req))
    anchors, positions, temps = static.plan(anchors_host, [context] * n_req, [1.0] * n_req)
    greedy, sampled = dspark.SamplingParams(), dspark.SamplingParams(temperature=1.0)
    cpu_gens = [torch.Generator().manual_seed(i) for i in range(n_req)]

    def dynamic(params):
        return drafter.propose(dstates, anchors_host.tolist(), params, cpu_gens, n_draft=n_draft)

    reference, eager = dynamic(greedy), static.propose(anchors, positions)
    row = {"requests": n_req, "context": context, "gamma": drafter.block_size, "n_draft": n_draft,
           "static_token_mismatches": int((eager.tokens != reference.tokens).sum()),
           "static_conf_logit_max_abs_diff": (eager.confidence_logits - reference.confidence_logits).abs().max().item(),
           "dynamic_ms": timed(lambda: dynamic(greedy), device, w, s),
           "static_eager_ms": timed(lambda: static.propose(anchors, positions), device, w, s),
           "dynamic_sampled_ms": timed(lambda: dynamic(sampled), device, w, s),
           "static_sampled_eager_ms": timed(lambda: static.propose(anchors, positions, temps), device, w, s)}
    if propose_graph is not None:
        replayed = propose_graph.replay(anchors, positions)
        row["graph_token_mismatches"] = int((replayed.tokens != reference.tokens).sum())
        row["graph_ms"] = timed(propose_graph.replay, device, w, s)
        # every slot sampled at T = 1: the engine's sampled rounds (replay and eager draw the same noise)
        sampled_graph = SampledProposeGraph(static.propose, n_req, device)
        q_graph = sampled_graph.replay(anchors, positions, temps).probs
        q_eager = static.propose(anchors, positions, temps).probs
        row["sampled_graph_q_max_abs_diff"] = (q_graph - q_eager).abs().max().item()
        row["sampled_graph_ms"] = timed(lambda: sampled_graph.replay(anchors, positions, temps), device, w, s)
    if profile:
        replay = (lambda: propose_graph.replay(anchors, positions)) if propose_graph is not None else (
            lambda: static.propose(anchors, positions))
        row["propose_profile"] = kernel_profile(replay, device, s)
        row["propose_op_sites"] = op_sites(lambda: static.propose(anchors, positions))
    width = (target.config.hc_mult, target.config.hidden_size)
    feats = {i: torch.randn(n_req, rows, *width, generator=g, device=device).to(target.dtype)
             for i in drafter.capture_layers}
    ids = torch.zeros(rows, dtype=torch.long, device=device)

    def observe_dynamic():  # each request commits γ + 1 rows (its length grows; only W rows are kept)
        for b, dstate in enumerate(dstates):
            drafter.observe(dstate, ids, None, {i: f[b] for i, f in feats.items()})

    row["observe_dynamic_ms"] = timed(observe_dynamic, device, w, s)
    row["observe_static_eager_ms"] = timed(lambda: static.observe(feats, positions), device, w, s)
    if observe_graph is not None:
        row["observe_graph_ms"] = timed(lambda: observe_graph.replay(feats, positions), device, w, s)
    if profile:
        replay = (lambda: observe_graph.replay(feats, positions)) if observe_graph is not None else (
            lambda: static.observe(feats, positions))
        row["observe_profile"] = kernel_profile(replay, device, s)
    print(json.dumps({k: v for k, v in row.items() if not k.endswith(("_profile", "_op_sites"))}), flush=True)
    for key in ("propose_profile", "observe_profile"):
        if key in row:
            summary = {k: v for k, v in row[key].items() if k != "top"}
            print(json.dumps({key: summary, "top": [(r["name"][:60], round(r["us_per_step"], 1), r["calls_per_step"])
                                                    for r in row[key]["top"][:15]]}), flush=True)
    if "propose_op_sites" in row:
        sites = row["propose_op_sites"]
        print(json.dumps({"propose_torch_ops": sites["torch_ops_per_step"],
                          "sites": [(r["site"][-60:], r["ops"]) for r in sites["top"][:20]]}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny-v4 on the CPU, torch references, no graph")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/graph-draft.json)")
    ap.add_argument("--requests", default=None, help="comma list of request counts (default 1,8,64; smoke 1,2)")
    ap.add_argument("--profile", action="store_true",
                    help="add the propose and observe replays' kernel-time breakdown and propose's torch-op sites "
                         "(with --no-pdl for per-kernel attribution)")
    ap.add_argument("--no-pdl", action="store_true", help="launch every Triton kernel without PDL")
    ap.add_argument("--n-draft", type=int, default=None,
                    help="slots drafted past the backbone per block, 1 .. γ (default γ)")
    cli = ap.parse_args()
    from dspark.kernels import triton_compat

    triton_compat.PDL = not cli.no_pdl  # this bench process only: the constant every launch consults
    out = cli.out or os.path.join(os.environ.get("OUT", "."), "graph-draft.json")
    args = dict(SMOKE if cli.smoke else FULL)
    if cli.requests:
        requests = tuple(int(n) for n in cli.requests.split(","))
        if not requests or min(requests) < 1:
            raise ValueError(f"--requests must list positive counts, got {cli.requests!r}")
        args["requests"] = requests
    args["n_draft"] = cli.n_draft  # validated by the drafters (ValueError names a bad value)
    device = torch.device("cpu" if cli.smoke else "cuda")
    dtype = torch.float32 if cli.smoke else torch.bfloat16
    model = dspark.init_model(load_config(args["config"]), seed=0, device=device, dtype=dtype,
                              kernels=KernelConfig.for_device(device))
    drafter = DSparkDrafter(model).init_weights(1)
    g = torch.Generator(device=device).manual_seed(0)
    results = {"conditions": {"device": _device_name(device), "torch": torch.__version__, "config": args["config"],
                              "dtype": str(dtype), "weights": "random (target and drafter)",
                              "kernels": str(model.kernels), "commit": git_commit(), "smoke": cli.smoke,
                              "gamma": drafter.block_size, "window": drafter.window,
                              "stages": drafter.config.num_stages, "grid": args, "pdl": not cli.no_pdl,
                              "draft_state": "fabricated at the context (random keys of the last W positions)",
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
               "cells": []}
    with torch.no_grad():
        for n_req in args["requests"]:
            results["cells"].append(cell(drafter, n_req, args, graphs=not cli.smoke, g=g, profile=cli.profile))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
