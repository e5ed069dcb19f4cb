"""Engram tables sharded by rows over two gloo ranks (`ParallelConfig(engram_shard=True)`).

One spawn of 2 processes (engram_shard_worker.run) serves the distributed tests. Checked, on
tiny-v41 with random weights: under "ep", "tp" and "dep" the logits with sharded tables are
bit-identical to the same layout with replicated tables and within fp32 tolerance of one
process, and greedy tokens equal one process's; under DEP a rank that never has a request joins
every lookup (`LockstepEngine.idle_forward`); direct lookups (fp32 and bf16, uneven row split)
equal the replicated table's exactly; `load_sharded` of a quantised checkpoint reads only this
rank's rows of each table (and of its scales) and equals the whole table sliced in memory.
Without a process group: the row-range reader and the refusals of bad configurations.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the worker by name
import engram_shard_worker as worker  # noqa: E402

ATOL = 1e-4


def _write_checkpoint(path):
    """tiny-v41 (random weights) rounded to and saved in the released quantised format."""
    from dspark.api import init_model
    from dspark.models.deepseek_v41.checkpoint import round_to_checkpoint_, save_checkpoint

    save_checkpoint(round_to_checkpoint_(init_model("tiny-v41", seed=0)), path, quantize=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks):
    out, checkpoint = tmp_path_factory.mktemp("engram_shard"), tmp_path_factory.mktemp("tiny_v41_fp8")
    _write_checkpoint(checkpoint)
    return spawn_ranks(worker.run, out, str(checkpoint), weights_only=False)


def _rows(requests):
    starts = [sum(len(p) for p in worker.PROMPTS[:i]) for i in range(len(worker.PROMPTS))]
    return torch.cat([torch.arange(starts[i], starts[i] + len(worker.PROMPTS[i])) for i in requests])


@pytest.mark.parametrize("layout", ["ep", "tp", "dep"])
def test_sharded_tables_give_the_replicated_logits_bit_for_bit(ranks, layout):
    for res in ranks:
        sharded, replicated = res[layout, True]["logits"], res[layout, False]["logits"]
        assert torch.equal(sharded, replicated)


@pytest.mark.parametrize("layout", ["ep", "tp", "dep"])
def test_sharded_tables_match_single_process(ranks, layout):
    for rank, res in enumerate(ranks):
        mine = worker.MINE[rank] if layout == "dep" else range(3)
        torch.testing.assert_close(res[layout, True]["logits"], res["ref_logits"][_rows(mine)], atol=ATOL, rtol=0)
        assert res[layout, True]["tokens"] == {i: res["ref_tokens"][i] for i in mine}
        assert all(len(res[layout, True]["tokens"][i]) == worker.MAX_NEW[i] for i in mine)


def test_each_rank_holds_its_rows(ranks):
    for rank, res in enumerate(ranks):  # tiny-v41 tables: 462 and 630 rows
        assert res["dep", "table_rows"] == [231, 315]


def test_dep_rank_without_requests_joins_every_lookup(ranks):
    assert ranks[1]["idle_tokens"] == {}
    assert ranks[0]["idle_tokens"] == ranks[0]["ref_tokens"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["same", "own", "idle"])
def test_lookups_equal_the_replicated_table_exactly(ranks, dtype, case):
    for res in ranks:
        sharded, replicated = res["lookups"][dtype][case]
        assert sharded.dtype == replicated.dtype == dtype
        assert torch.equal(sharded, replicated)
    assert [res["lookups"][dtype]["rows"] for res in ranks] == [50, 51]


def test_sharded_load_reads_only_its_rows(ranks):
    for rank, res in enumerate(ranks):
        load = res["load"]
        assert load["state"].keys() == load["reference"].keys() and len(load["state"]) == 2
        for name, tensor in load["reference"].items():
            assert torch.equal(load["state"][name], tensor), name
        table_reads = [(key, how, size) for key, how, size in load["reads"] if ".engram.embed." in key]
        assert {how for _, how, _ in table_reads} == {"part"}
        assert {key for key, _, _ in table_reads} == {f"layers.{i}.engram.embed.{s}" for i in (1, 4)
                                                     for s in ("weight", "scale")}
        # FP8 rows of 32 values (32 B) + one UE8M0 scale byte each: 231 + 315 of 462 + 630 rows.
        assert sum(size for *_, size in table_reads) == (231 + 315) * (32 + 1)


def test_sharded_checkpoint_generates_single_process_tokens(ranks):
    for rank, res in enumerate(ranks):
        assert res["load"]["tokens"] == {i: res["ref_ckpt_tokens"][i] for i in worker.MINE[rank]}


# --------------------------------------------------------------------------------------------
# Without a process group
# --------------------------------------------------------------------------------------------


def test_row_ranges_of_an_fp8_rows_table_read_their_scale_rows(tmp_path):
    from safetensors.torch import save_file

    from dspark.distributed.engram_shard import owned_rows
    from dspark.distributed.tp_loading import range_source
    from dspark.loader import SafetensorsReader
    from dspark.quant import ENGRAM_BLOCK, FP4_BLOCK, dequantize, quantize_fp8

    data, scale = quantize_fp8(torch.randn(7, 64, generator=torch.Generator().manual_seed(0)), ENGRAM_BLOCK)
    save_file({"t.weight": data, "t.scale": scale}, str(tmp_path / "model.safetensors"))
    full = dequantize(data, scale, ENGRAM_BLOCK)
    with SafetensorsReader(tmp_path) as reader:
        parts = []
        for rank in range(3):  # 7 rows over 3 ranks: 2, 2, 3
            rows = owned_rows(7, rank, 3)
            source, problem = range_source(reader, "t.weight", 0, rows.start, rows.stop, ENGRAM_BLOCK, FP4_BLOCK)
            assert problem is None and source.shape == (len(rows), 64)
            parts.append(source.read(torch.device("cpu")))
        assert [p.shape[0] for p in parts] == [2, 2, 3]
        assert torch.equal(torch.cat(parts), full)
        _, problem = range_source(reader, "t.weight", 1, 0, 48, ENGRAM_BLOCK, FP4_BLOCK)
        assert "cuts its fp8 scale blocks of 32" in problem


def _comm(rank, size):
    from dspark.distributed import Comm

    return Comm(None, rank, size, torch.device("cpu"))


@pytest.mark.parametrize("kwargs, word", [
    (dict(world_size=1, engram_shard=True), "world_size=1"),
    (dict(world_size=2, ep=2, engram_shard="yes"), "engram_shard must be a bool, got 'yes'"),
    (dict(world_size=2, tp=2, engram_shard=1), "engram_shard must be a bool, got 1"),
])
def test_bad_engram_shard_configs_name_the_value(kwargs, word):
    from dspark.distributed import ParallelConfig

    with pytest.raises(ValueError, match=word):
        ParallelConfig(**kwargs)


def test_engram_shard_refuses_a_model_without_engram():
    from dspark.api import init_model
    from dspark.distributed import ParallelConfig, parallelize

    with pytest.raises(ValueError, match="engram_shard=True, but DeepseekV4ForCausalLM has no Engram"):
        parallelize(init_model("tiny-v4"), ParallelConfig(2, 0, ep=2, engram_shard=True), _comm(0, 2))


def test_engram_shard_refuses_more_ranks_than_rows():
    from dspark.distributed.engram_shard import ShardedEngramTable
    from dspark.models.deepseek_v41.engram import EngramTable

    with pytest.raises(ValueError, match="3 rows cannot be split over 4 ranks"):
        ShardedEngramTable.from_table(EngramTable(3, 32), _comm(0, 4), exchange=False)


def test_host_tables_are_deferred_and_recreated_at_the_rank_share():
    """A GPU run keeps the released tables in host memory: `deferred_weights(host=True)` must not
    allocate them whole, and the sharded table then allocates only this rank's rows, on the host."""
    from dspark.distributed.deferred import deferred_weights
    from dspark.distributed.engram_shard import ShardedEngramTable
    from dspark.models.deepseek_v41.engram import EngramTable

    accelerator = torch.device("cuda", 0)  # only compared against, never allocated on
    with deferred_weights(accelerator):
        assert not EngramTable(10, 32, host=True).weight.is_meta  # host tables are left alone by default
    with deferred_weights(accelerator, host=True):
        table = EngramTable(10, 32, host=True)
    assert table.weight.is_meta
    sharded = ShardedEngramTable.from_table(table, _comm(1, 2), exchange=True)
    assert sharded.host and not sharded.weight.is_meta
    assert sharded.weight.device.type == "cpu" and sharded.weight.shape == (5, 32)


def test_cli_engram_shard(capsys):
    from dspark.cli import main
    from dspark.distributed.launch import config_from_env

    env = {"WORLD_SIZE": "2", "RANK": "0"}
    assert config_from_env(2, 1, True, "gloo", env, engram_shard=True).engram_shard
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "a", "--model", "random-tiny", "--max-new-tokens", "1", "--engram-shard"])
    assert exit_info.value.code == 2
    assert "--engram-shard needs --ep or --tp" in capsys.readouterr().err
