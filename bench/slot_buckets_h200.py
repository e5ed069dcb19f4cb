"""Static decode over slot buckets: the engine's step time vs live requests n on one 64-slot engine.

    PYTHONPATH=. python bench/slot_buckets_h200.py --out $OUT/slot-buckets-h200.json   # one H200, ~3-5 min
    PYTHONPATH=. python bench/slot_buckets_h200.py --smoke --out /tmp/slot-buckets.json  # CPU, tiny-v4

One `Engine(EngineConfig(static_decode=True, max_running=64))` per mode (none: plain decode, T = 1;
dspark3: DSpark drafts on the static drafter, budget 3, T = 4) on v4-mini (random weights, bf16) at
a 4K context. It is filled with 64 decoding requests of fabricated state (`engine_h200.inject`),
then requests are aborted, from the middle of the slot range first, down to n = 64, 33, 32, 16, 8, 2
and 1 live ones; every abort frees a slot in the middle, so the engine compacts (moves the last
slot's request into the gap). At each n: `warmup` untimed then `steps` timed `Engine.step()`s
(CUDA synchronised), median step time, the bucket b the target step ran on (the slots of its graph)
and the slot moves done so far. Before buckets every step ran all 64 slots, so the n = 64 row is
also the old step time at any n. `engine_build_s` is the capture of every (b, t) graph.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_h200's fabricated requests

import dspark  # noqa: E402
from dspark.configs import load_config  # noqa: E402
from dspark.draft import DSparkDrafter  # noqa: E402
from dspark.engine import Engine, EngineConfig  # noqa: E402
from engine_h200 import _device_name, _sync, inject  # noqa: E402
from provenance import git_commit  # noqa: E402

FULL = dict(config="v4-mini", slots=64, live=(64, 33, 32, 16, 8, 2, 1), context=4096, warmup=2, steps=5)
SMOKE = dict(config="tiny-v4", slots=4, live=(4, 3, 2, 1), context=40, warmup=1, steps=2)


def _spy(engine: Engine) -> dict:
    """Record each static step's (bucket, width) and every slot move of `engine`."""
    seen = {"steps": [], "moves": 0}
    step, move = engine.runner.step, engine.runner.move

    def stepping(ids, starts):
        seen["steps"].append(tuple(ids.shape))
        return step(ids, starts)

    def moving(src, dst):
        seen["moves"] += 1
        move(src, dst)

    engine.runner.step, engine.runner.move = stepping, moving
    return seen


def run_mode(model, drafter, budget, args, g) -> dict:
    """One engine of `slots` slots, emptied step by step: a row per live count n."""
    total_steps = len(args["live"]) * (args["warmup"] + args["steps"])
    _sync(model.device)
    t = time.perf_counter()
    engine = Engine(model, EngineConfig(max_running=args["slots"], max_prompt_tokens=args["context"] + 1,
                                        max_new_tokens=10**6, draft_tokens=budget, drafter=drafter,
                                        static_decode=True, static_context=args["context"] + 8 * total_steps))
    _sync(model.device)
    build_s = time.perf_counter() - t
    seen = _spy(engine)
    inject(engine, model, drafter, args["slots"], args["context"], g)
    rows = []
    for n in args["live"]:
        live = sorted(engine.running, key=lambda r: r.state.slot if hasattr(r.state, "slot") else -1)
        for req in live[len(live) // 2 - (len(live) - n) // 2 :][: len(live) - n]:  # the middle slots first
            engine.abort(req.request_id)
        times = []
        for i in range(args["warmup"] + args["steps"]):
            _sync(model.device)
            t = time.perf_counter()
            engine.step()
            _sync(model.device)
            if i >= args["warmup"]:
                times.append(time.perf_counter() - t)
        buckets = sorted({b for b, _ in seen["steps"][-args["steps"]:]})
        rows.append({"live": len(engine.running), "buckets": buckets, "step_ms": statistics.median(times) * 1e3,
                     "step_ms_all": [x * 1e3 for x in times], "moves_so_far": seen["moves"]})
        print(json.dumps(rows[-1]), flush=True)
    graphs = sorted(engine.runner.graphs)
    return {"engine_build_s": build_s, "graphs": [list(k) for k in graphs],
            "draft_graphs": None if engine.static_draft is None else {
                "observe": [list(k) for k in sorted(engine.static_draft.observe_graphs)],
                "propose": sorted(engine.static_draft.propose_graphs)},
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU: checks the script")
    cli = ap.parse_args()
    args = dict(SMOKE if cli.smoke else FULL)
    device = torch.device("cpu" if cli.smoke else "cuda")
    torch.manual_seed(0)
    g = torch.Generator(device=device).manual_seed(0)
    model = dspark.init_model(load_config(args["config"]), seed=0, device=device,
                              dtype=torch.float32 if cli.smoke else torch.bfloat16)
    drafter = DSparkDrafter(model).init_weights(1)
    results = {"conditions": {"device": _device_name(device), "torch": torch.__version__, "commit": git_commit(),
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "weights": "random", "kernels": str(model.kernels), "smoke": cli.smoke, **args},
               "modes": {}}
    with torch.inference_mode():
        for mode, (d, budget) in {"none": (None, 0), "dspark3": (drafter, 3)}.items():
            results["modes"][mode] = run_mode(model, d, budget, args, g)
            with open(cli.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
