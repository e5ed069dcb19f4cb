"""Two gloo ranks against one process: DEP (DP attention + expert parallelism), EP and TP MoE.

One spawn of 2 processes (dist_worker.run) serves every test here. Checked: logits of a ragged
prefill within fp32 tolerance for the three layouts (V4 tiny, random weights); greedy tokens of a
lockstep engine identical to the single-process engine, for V4 tiny with its MTP drafter and for
the embedded V4.1 dspark-tiny with its DSpark drafter and the confidence planner ("auto"), the
latter loaded shard by shard (each rank reads only its experts).
"""

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import dist_worker by name
import dist_worker  # noqa: E402

ATOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(dist_worker.run, args=(_free_port(), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _rows(requests):
    """Row ranges of `requests` (indices into PROMPTS) in the all-requests reference call."""
    starts = [sum(len(p) for p in dist_worker.PROMPTS[:i]) for i in range(len(dist_worker.PROMPTS))]
    return torch.cat([torch.arange(starts[i], starts[i] + len(dist_worker.PROMPTS[i])) for i in requests])


def test_dep_logits_match_single_process(ranks):
    for rank, res in enumerate(ranks):
        ref = res["ref_logits"][_rows(dist_worker.MINE[rank])]
        torch.testing.assert_close(res["dep_logits"], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_replicated_layouts_match_single_process(ranks, layout):
    for res in ranks:
        torch.testing.assert_close(res[f"{layout}_logits"], res["ref_logits"], atol=ATOL, rtol=0)


def test_dep_engine_greedy_tokens_v4_mtp(ranks):
    for rank, res in enumerate(ranks):
        mine = dist_worker.MINE[rank]
        assert res["dep_v4_tokens"] == {i: res["ref_v4_tokens"][i] for i in mine}
        assert all(len(res["dep_v4_tokens"][i]) == dist_worker.MAX_NEW[i] for i in mine)


def test_dep_engine_greedy_tokens_v41_dspark_sharded(ranks):
    for rank, res in enumerate(ranks):
        mine = dist_worker.MINE[rank]
        assert res["dep_v41_drafter"] == "DSparkDrafter"
        assert res["dep_v41_tokens"] == {i: res["ref_v41_tokens"][i] for i in mine}


def test_sharded_load_holds_only_owned_experts(ranks):
    for rank, res in enumerate(ranks):
        experts = {int(k.split(".")[4]) for k in res["v41_expert_keys"]}
        assert experts == set(range(4 * rank, 4 * rank + 4))  # 8 experts, 2 ranks
