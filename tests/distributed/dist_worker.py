"""The per-rank body of tests/distributed/test_dist_dep.py (spawned twice, gloo backend).

Each rank computes the single-process reference itself (same seeds, all requests), then joins a
2-rank group, parallelises a fresh model and runs its share; results go to `out/rank{r}.pt` for
the test to compare.
"""

import json
from importlib import resources

import torch

from dspark.api import init_model, load_model
from dspark.distributed import LockstepEngine, ParallelConfig, init_distributed, load_sharded, parallelize, shutdown
from dspark.engine.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams

PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9]
MINE = {0: [0, 1], 1: [2]}  # uneven on purpose: rank 1 idles in some phases
MAX_NEW = [10, 14, 5]


def tiny_v4():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return init_model(config, seed=0)


def forward_logits(model, prompts):
    states = [model.new_state() for _ in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    return model(ids, states, [len(p) for p in prompts]).logits


def generate(engine_cls, model, which, engine_config, *extra):
    engine = engine_cls(model, engine_config, *extra)
    ids = {i: engine.add_request(PROMPTS[i], SamplingParams(temperature=0.0), MAX_NEW[i]) for i in which}
    out = {rid: [] for rid in ids.values()}
    more = engine.has_work_anywhere if hasattr(engine, "has_work_anywhere") else engine.has_work
    while more():
        for event in engine.step():
            out[event.request_id] += event.new_token_ids
    return {i: out[rid] for i, rid in ids.items()}


def run(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    mine = MINE[rank]
    results = {}
    mtp = EngineConfig(max_running=4, draft_tokens=1, drafter="mtp")
    dspark_auto = EngineConfig(max_running=4, draft_tokens="auto", drafter="dspark")
    # Single-process references (no process group yet).
    results["ref_logits"] = forward_logits(tiny_v4(), PROMPTS)
    results["ref_v4_tokens"] = generate(Engine, tiny_v4(), range(3), mtp)
    results["ref_v41_tokens"] = generate(Engine, load_model("tiny"), range(3), dspark_auto)

    comms = {}
    for layout, kwargs in (("dep", dict(ep=2, dp_attention=True)), ("ep", dict(ep=2)), ("tp", dict(tp=2))):
        config = ParallelConfig(2, rank, **kwargs)
        comm = comms.setdefault("c", None) or init_distributed(config, f"tcp://127.0.0.1:{port}")
        comms["c"] = comm
        model = tiny_v4()
        parallelize(model, config, comm)
        prompts = [PROMPTS[i] for i in mine] if layout == "dep" else PROMPTS
        results[f"{layout}_logits"] = forward_logits(model, prompts)

    config = ParallelConfig(2, rank, ep=2, dp_attention=True)
    comm = comms["c"]
    model = tiny_v4()
    layers = parallelize(model, config, comm)
    results["dep_v4_tokens"] = generate(LockstepEngine, model, mine, mtp, comm, layers)
    model, layers = load_sharded("tiny", config, comm)
    results["v41_expert_keys"] = sorted(k for k in model.state_dict() if ".ffn.experts." in k and k.startswith("layers."))
    results["dep_v41_tokens"] = generate(LockstepEngine, model, mine, dspark_auto, comm, layers)
    results["dep_v41_drafter"] = type(model.dspark).__name__
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    shutdown()
