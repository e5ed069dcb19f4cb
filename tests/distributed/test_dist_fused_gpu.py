"""The fused TP MoE epilogue on two GPUs (NCCL + symmetric memory): bit-identical to the reference.

    pytest -q tests/distributed/test_dist_fused_gpu.py        # a machine with >= 2 GPUs (nvidia-h200-x2)

Two spawned ranks check, with NVLink multicast off: `moe_epilogue` (push into the peers' buffers,
signal-pad barrier, Triton finalize) against `moe_epilogue_ref` (NCCL all-reduce + torch ops) at
decode sizes of v4-mini (K = 6, D = 2048) in bf16 and fp32, several calls in a row (both buffer
parities; partials given as a separate tensor and computed in place in the slot); the outputs of
both ranks identical; and a whole bf16 tiny V4 under TP2 with `tp_epilogue="fused"` against
`"ref"`: prefill logits bit for bit, greedy tokens equal.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import this module and its helpers by name
from test_dist_epilogue import epilogue_inputs  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")]
PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9]


def _tiny_tp(epilogue, rank, comm):
    from dspark.api import init_model
    from dspark.distributed import ParallelConfig, parallelize
    from dspark.kernels import KernelConfig

    model = init_model("tiny-v4", seed=0, device=f"cuda:{rank}", dtype=torch.bfloat16,
                       kernels=KernelConfig.uniform("ref"))  # the MoE epilogue is what differs
    layers = parallelize(model, ParallelConfig(2, rank, local_rank=rank, tp=2, backend="nccl",
                                               tp_epilogue=epilogue), comm)
    return model, layers


def _whole_model(rank, comm):
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.sampling import SamplingParams

    out = {}
    for epilogue in ("ref", "fused"):
        model, layers = _tiny_tp(epilogue, rank, comm)
        out[f"{epilogue}_workspace"] = layers[0].workspace is not None
        with torch.inference_mode():
            states = [model.new_state() for _ in PROMPTS]
            ids = torch.tensor(sum(PROMPTS, []), device=f"cuda:{rank}")
            out[f"{epilogue}_logits"] = model(ids, states, [len(p) for p in PROMPTS]).logits.cpu()
            engine = Engine(model, EngineConfig(max_running=4, draft_tokens=0))
            rids = [engine.add_request(p, SamplingParams(temperature=0.0), 12) for p in PROMPTS]
            tokens = {r: [] for r in rids}
            while engine.has_work():
                for event in engine.step():
                    tokens[event.request_id] += event.new_token_ids
            out[f"{epilogue}_tokens"] = [tokens[r] for r in rids]
    return out


def _rank(rank, port, out_dir):
    from dspark.distributed import ParallelConfig, init_distributed, shutdown
    from dspark.distributed.fused_allreduce import PushWorkspace, fused_unsupported, moe_epilogue, moe_epilogue_ref

    comm = init_distributed(ParallelConfig(2, rank, local_rank=rank, tp=2, backend="nccl"), f"tcp://127.0.0.1:{port}")
    device = torch.device("cuda", rank)
    res = {"unsupported": fused_unsupported(comm), "pairs": []}
    workspace = PushWorkspace.create(comm, 64 * 7, 2048)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 8, 33, 64):
            for call in range(3):
                partials, weights, ids = epilogue_inputs(n, 6, 2048, 2, seed=1000 * n + call, n_experts=64)
                mine, weights, ids = partials[rank].to(device), weights.to(device), ids.to(device)
                if call == 1:  # computed in place, as ColumnMoE does
                    fused = moe_epilogue(workspace.partial(n, 6).copy_(mine), weights, ids, dtype, workspace)
                else:
                    fused = moe_epilogue(mine.clone(), weights, ids, dtype, workspace)
                ref = moe_epilogue_ref(mine.clone(), weights, ids, dtype, comm)
                res["pairs"].append((fused.cpu(), ref.cpu()))
    res.update(_whole_model(rank, comm))
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks):
    out = tmp_path_factory.mktemp("fused")
    with pytest.MonkeyPatch.context() as env:  # inherited by the spawned ranks
        env.setenv("NCCL_NVLS_ENABLE", "0")
        env.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        return spawn_ranks(_rank, out)


def test_fused_epilogue_equals_reference_bitwise(ranks):
    for res in ranks:
        assert res["unsupported"] is None
        for fused, ref in res["pairs"]:
            assert fused.dtype == ref.dtype and torch.equal(fused.view(torch.uint8), ref.view(torch.uint8))
    for (a, _), (b, _) in zip(ranks[0]["pairs"], ranks[1]["pairs"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # identical on both ranks


def test_tp_model_fused_equals_reference(ranks):
    for res in ranks:
        assert res["fused_workspace"] and not res["ref_workspace"]
        assert torch.equal(res["fused_logits"].view(torch.uint8), res["ref_logits"].view(torch.uint8))
        assert res["fused_tokens"] == res["ref_tokens"]
