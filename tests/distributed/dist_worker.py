"""The per-rank body of tests/distributed/test_dist_dep.py (spawned twice, gloo backend).

Each rank computes the single-process reference itself (same seeds, all requests), then joins a
2-rank group, parallelises a fresh model and runs its share; results go to `out/rank{r}.pt` for
the test to compare.
"""

import copy
import json
from importlib import resources

import torch

from dspark.api import EMBEDDED, build_model, init_model, load_model
from dspark.distributed import LockstepEngine, ParallelConfig, init_distributed, load_sharded, parallelize, shutdown
from dspark.engine.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams

PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9]
MINE = {0: [0, 1], 1: [2]}  # uneven on purpose: rank 1 idles in some phases
MAX_NEW = [10, 14, 5]


def tiny_v4():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return init_model(config, seed=0)


def bf16_layer_checks(comm, rank):
    """Layer 2 of a bf16 tiny V4, one process vs this rank's tp pieces, on the same inputs: the
    MoE block's output, this rank's query heads and the attention output projection. Returns the
    parallel and reference tensors (bf16), for the test to count bitwise-equal elements."""
    from dspark.distributed.attention import split_heads
    from dspark.distributed.moe import ColumnMoE

    layer = tiny_v4_bf16().layers[2]
    attn, moe = copy.deepcopy(layer.attn), copy.deepcopy(layer.ffn)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16)  # [N, D], the same on both ranks
    ids = torch.randint(0, 258, (16,), generator=gen)
    cos, sin = attn.rope.cos_sin(torch.arange(16))
    out = torch.randn(16, 4, 32, generator=gen).to(torch.bfloat16)  # an attention core output [N, H, d]
    heads = slice(2 * rank, 2 * rank + 2)  # H = 4, 2 ranks
    res = {"moe": (ColumnMoE(moe, comm)(x, ids), layer.ffn(x, ids)),
           "q": (split_heads(attn, comm).project_qkv(x, cos, sin)[1], layer.attn.project_qkv(x, cos, sin)[1][:, heads]),
           "o": (attn.project_out(out[:, heads], cos, sin), layer.attn.project_out(out, cos, sin))}
    return res


def tiny_v4_bf16():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return init_model(config, seed=0, dtype=torch.bfloat16)


def expert_bytes(model) -> int:
    """Bytes of the distinct real storages behind the target layers' routed expert weights."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for name, p in model.named_parameters() if ".ffn.experts." in name and name.startswith("layers.")
                and not p.is_meta}
    return sum(storages.values())


def expert_bytes_by_stage(config, comm):
    """Routed-expert storage of the V4.1 dspark-tiny on this rank after each step of `build_sharded`,
    and what all experts of all layers take (fp32)."""
    from dspark.distributed.deferred import deferred_weights, materialize

    with deferred_weights("cpu"):
        model = build_model(json.loads((EMBEDDED["tiny"] / "config.json").read_text()), "cpu")
    c = model.config
    total = len(model.layers) * c.n_routed_experts * 3 * c.moe_intermediate_size * c.hidden_size * 4
    stages = {"built": expert_bytes(model)}
    parallelize(model, config, comm)
    stages["parallelized"] = expert_bytes(model)
    stages["materialized"] = expert_bytes(materialize(model, "cpu"))
    return stages, total


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
    results["ref_v41_logits"] = forward_logits(load_model("tiny", prefill_mode="exact"), PROMPTS)

    comms = {}
    for layout, kwargs in (("dep", dict(ep=2, dp_attention=True)), ("ep", dict(ep=2)), ("tp", dict(tp=2))):
        config = ParallelConfig(2, rank, **kwargs)
        comm = comms.setdefault("c", None) or init_distributed(config, f"tcp://127.0.0.1:{port}")
        comms["c"] = comm
        model = tiny_v4()
        parallelize(model, config, comm)
        prompts = [PROMPTS[i] for i in mine] if layout == "dep" else PROMPTS
        results[f"{layout}_logits"] = forward_logits(model, prompts)
        if layout == "tp":
            results["tp_shapes"] = {k: tuple(v.shape) for k, v in model.layers[0].attn.state_dict().items()}
            results["tp_v4_tokens"] = generate(Engine, model, range(3), mtp)
            model = load_model("tiny", prefill_mode="exact")
            parallelize(model, config, comm)
            results["tp_v41_logits"] = forward_logits(model, PROMPTS)
            model = load_model("tiny")
            parallelize(model, config, comm)
            results["tp_v41_tokens"] = generate(Engine, model, range(3), dspark_auto)
            results["tp_bf16"] = bf16_layer_checks(comm, rank)

    config = ParallelConfig(2, rank, ep=2, dp_attention=True)
    comm = comms["c"]
    model = tiny_v4()
    layers = parallelize(model, config, comm)
    results["dep_v4_tokens"] = generate(LockstepEngine, model, mine, mtp, comm, layers)
    results["expert_bytes"], results["expert_total"] = expert_bytes_by_stage(config, comm)
    model, layers = load_sharded("tiny", config, comm)
    results["expert_bytes"]["loaded"] = expert_bytes(model)
    results["v41_expert_keys"] = sorted(k for k in model.state_dict() if ".ffn.experts." in k and k.startswith("layers."))
    results["dep_v41_tokens"] = generate(LockstepEngine, model, mine, dspark_auto, comm, layers)
    results["dep_v41_drafter"] = type(model.dspark).__name__
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    shutdown()
