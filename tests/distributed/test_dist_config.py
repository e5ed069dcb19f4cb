"""ParallelConfig validation and the expert split (no process group needed)."""

import pytest

from dspark.distributed import ParallelConfig, expert_slice


@pytest.mark.parametrize("kwargs, layout", [
    (dict(), "single"),
    (dict(world_size=2, ep=2, dp_attention=True), "dep"),
    (dict(world_size=4, ep=4), "ep"),
    (dict(world_size=2, tp=2), "tp"),
])
def test_layouts(kwargs, layout):
    config = ParallelConfig(**kwargs)
    assert config.layout == layout
    assert config.dp_size == (config.world_size if layout == "dep" else 1)


@pytest.mark.parametrize("kwargs, word", [
    (dict(world_size=2, ep=2, tp=2), "tp=2"),
    (dict(world_size=4, ep=2), "world_size=4"),
    (dict(world_size=2, rank=2, ep=2), "rank 2"),
    (dict(world_size=2, tp=2, dp_attention=True), "dp_attention"),
    (dict(backend="mpi"), "'mpi'"),
    (dict(world_size=0), "world_size"),
    (dict(world_size=2, tp=2, tp_epilogue="fast"), "'fast'"),
    (dict(world_size=2, tp=2, tp_epilogue="fused"), "backend='gloo'"),
    (dict(world_size=2, ep=2, backend="nccl", tp_epilogue="fused"), "tp=1"),
    (dict(world_size=2, tp=2, tp_fused_tokens=0), "tp_fused_tokens"),
])
def test_bad_configs_name_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ParallelConfig(**kwargs)


def test_expert_slice_is_contiguous_and_covers_all():
    assert [expert_slice(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="n_routed_experts=6"):
        expert_slice(6, 0, 4)


def test_launcher_reads_torchrun_variables():
    from dspark.distributed.launch import config_from_env

    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    config = config_from_env(2, 1, True, "gloo", env)
    assert (config.world_size, config.rank, config.local_rank, config.layout) == (2, 1, 1, "dep")
    assert config_from_env(1, 1, False, "gloo", {}).layout == "single"
    with pytest.raises(ValueError, match="RANK='x'"):
        config_from_env(2, 1, False, "gloo", {"WORLD_SIZE": "2", "RANK": "x"})


def test_cli_needs_a_parallel_run_for_several_prompts(capsys):
    from dspark.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "a", "b", "--model", "random-tiny", "--max-new-tokens", "1"])
    assert exit_info.value.code == 2
    assert "2 prompts given" in capsys.readouterr().err
