"""The per-rank body of tests/distributed/test_dist_engram_shard.py (spawned twice, gloo backend).

Each rank computes the single-process references first (tiny-v41 with random weights, and a
quantised checkpoint of it written by the test), then joins a 2-rank group and runs the same with
the Engram tables sharded (`engram_shard=True`) and, for comparison, replicated. Results go to
`out/rank{r}.pt` for the test to compare.
"""

import torch

from dspark.api import init_model, load_model
from dspark.distributed import LockstepEngine, ParallelConfig, init_distributed, load_sharded, parallelize, shutdown
from dspark.distributed.engram_shard import ShardedEngramTable
from dspark.engine.engine import Engine, EngineConfig
from read_log import recorded_reads
from dspark.models.deepseek_v41.engram import EngramTable
from dspark.sampling import SamplingParams

PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9]
MAX_NEW = [6, 9, 4]
MINE = {0: [0, 1], 1: [2]}  # uneven: rank 1 finishes first and idles
ALL_ON_ZERO = {0: [0, 1, 2], 1: []}  # rank 1 never has a request
LAYOUTS = {"ep": dict(ep=2), "tp": dict(tp=2), "dep": dict(ep=2, dp_attention=True)}
ENGINE = EngineConfig(max_running=4)


def forward_logits(model, prompts):
    states = [model.new_state() for _ in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    return model(ids, states, [len(p) for p in prompts]).logits


def generate(engine, which):
    ids = {i: engine.add_request(PROMPTS[i], SamplingParams(temperature=0.0), MAX_NEW[i]) for i in which}
    out = {rid: [] for rid in ids.values()}
    more = engine.has_work_anywhere if isinstance(engine, LockstepEngine) else engine.has_work
    while more():
        for event in engine.step():
            out[event.request_id] += event.new_token_ids
    return {i: out[rid] for i, rid in ids.items()}


def run_layout(make_model, layout, rank, comm, shard):
    """Logits of this rank's prompts and greedy tokens, tables sharded or not."""
    config = ParallelConfig(2, rank, engram_shard=shard, **LAYOUTS[layout])
    model = make_model()
    layers = parallelize(model, config, comm)
    mine = MINE[rank] if layout == "dep" else range(3)
    logits = forward_logits(model, [PROMPTS[i] for i in mine])
    engine = LockstepEngine(model, ENGINE, comm, layers) if layout == "dep" else Engine(model, ENGINE)
    return logits, generate(engine, mine), model


def lookups(rank, comm):
    """Direct lookups of a random table, fp32 and bf16, replicated vs sharded: the same columns on
    both ranks (all-reduce), different ones (exchange), and no columns on rank 1 (exchange)."""
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(3)
        table = EngramTable(101, 16, dtype=dtype)  # 101 rows: an uneven split (50 / 51)
        table.weight.data.copy_(torch.randn(101, 16, generator=g).to(dtype))
        same = torch.randint(0, 101, (7, 5), generator=g)
        own = torch.randint(0, 101, (4 + 5 * rank, 5), generator=g.manual_seed(10 + rank))
        summed = ShardedEngramTable.from_table(table, comm, exchange=False)
        exchanged = ShardedEngramTable.from_table(table, comm, exchange=True)
        cpu = torch.device("cpu")
        res[dtype] = {"same": (summed.lookup(same, cpu), table.lookup(same, cpu)),
                      "own": (exchanged.lookup(own, cpu), table.lookup(own, cpu)),
                      "rows": summed.weight.shape[0]}
        empty = torch.empty(0, 5, dtype=torch.long)
        res[dtype]["idle"] = (exchanged.lookup(own if rank == 0 else empty, cpu),
                              table.lookup(own if rank == 0 else empty, cpu))
    return res


def load_checkpoint(rank, comm, checkpoint):
    """`load_sharded` of the quantised checkpoint under DEP with sharded tables, every read recorded;
    the same checkpoint loaded whole and sharded in memory; greedy tokens of the loaded model."""
    config = ParallelConfig(2, rank, ep=2, dp_attention=True, engram_shard=True)
    with recorded_reads() as reads:
        sharded, layers = load_sharded(checkpoint, config, comm)
    reference = load_model(checkpoint)
    parallelize(reference, config, comm)
    tokens = generate(LockstepEngine(sharded, ENGINE, comm, layers), MINE[rank])
    state = {k: v for k, v in sharded.state_dict().items() if ".engram.embed." in k}
    return {"state": state, "reference": {k: reference.state_dict()[k] for k in state}, "reads": reads,
            "tokens": tokens}


def run(rank: int, port: int, out_dir: str, checkpoint: str) -> None:
    torch.set_num_threads(1)

    def make_model():
        return init_model("tiny-v41", seed=0, prefill_mode="exact")  # every logits row computed

    reference = make_model()
    res = {"ref_logits": forward_logits(reference, PROMPTS),
           "ref_tokens": generate(Engine(reference, ENGINE), range(3)),
           "ref_ckpt_tokens": generate(Engine(load_model(checkpoint), ENGINE), range(3))}
    comm = init_distributed(ParallelConfig(2, rank, ep=2), f"tcp://127.0.0.1:{port}")
    for layout in LAYOUTS:
        for shard in (False, True):
            logits, tokens, model = run_layout(make_model, layout, rank, comm, shard)
            res[layout, shard] = {"logits": logits, "tokens": tokens}
        res[layout, "table_rows"] = [model.layers[i].engram.embed.weight.shape[0] for i in model.engram_ids]
    model = make_model()
    config = ParallelConfig(2, rank, ep=2, dp_attention=True, engram_shard=True)
    engine = LockstepEngine(model, ENGINE, comm, parallelize(model, config, comm))
    res["idle_tokens"] = generate(engine, ALL_ON_ZERO[rank])
    res["lookups"] = lookups(rank, comm)
    res["load"] = load_checkpoint(rank, comm, checkpoint)
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    shutdown()
