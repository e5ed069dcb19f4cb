"""Sharded loading under "tp" (dspark/distributed/tp_loading.py), two gloo ranks.

Each rank loads the embedded V4.1 dspark-tiny with `load_sharded(..., tp=2)` while every read of
the checkpoint is recorded, and compares its model with the whole checkpoint loaded in one
process and then `parallelize`d (which slices in memory). Checked: identical state dicts; every
split tensor (heads, expert widths) read only as this rank's half, never whole; and the
slice planner's refusals (a quantised cut inside a scale block).
"""


import pytest
import torch

from dspark.distributed.tp_loading import split_axis


def _rank(rank, port, out_dir):
    from dspark.api import EMBEDDED, load_model
    from dspark.distributed import ParallelConfig, init_distributed, load_sharded, parallelize, shutdown
    from dspark.loader import SafetensorsReader
    from read_log import recorded_reads

    torch.set_num_threads(1)
    config = ParallelConfig(2, rank, tp=2)
    comm = init_distributed(config, f"tcp://127.0.0.1:{port}")
    with recorded_reads() as reads:  # (key, how, bytes)
        sharded, _ = load_sharded("tiny", config, comm)
    reference = load_model("tiny")
    parallelize(reference, config, comm)
    with SafetensorsReader(EMBEDDED["tiny"]) as reader:
        sizes = {key: reader.get(key).numel() * reader.get(key).element_size() for key in reader.keys()}
    torch.save({"sharded": sharded.state_dict(), "reference": reference.state_dict(), "reads": reads,
                "sizes": sizes}, f"{out_dir}/rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawn_ranks):
    out = tmp_path_factory.mktemp("tp_loading")
    return spawn_ranks(_rank, out)


def test_tp_sharded_load_equals_sliced_full_load(ranks):
    for res in ranks:
        sharded, reference = res["sharded"], res["reference"]
        assert sharded.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(sharded[name], tensor), name


def test_tp_ranks_read_only_their_slices(ranks):
    for res in ranks:
        split = {key for key in res["sizes"] if split_axis(key) is not None}
        assert len(split) > 100  # every layer's heads and every expert's three weights
        parts = {key: size for key, how, size in res["reads"] if how == "part"}
        assert not [key for key, how, _ in res["reads"] if how == "whole" and key in split]
        assert parts.keys() == split
        assert all(2 * size == res["sizes"][key] for key, size in parts.items())
        layers = [key for key in res["sizes"] if key.startswith("layers.")]  # the target's layers, read once
        read = sum(size for key, _, size in res["reads"] if key.startswith("layers."))
        assert read == sum(res["sizes"][key] // (2 if key in split else 1) for key in layers)


def _quantised_checkpoint(path):
    """One FP8 (32×32 blocks) and one FP4 (1×32 blocks) weight per split axis, with their scales;
    returns the dequantised full tensors."""
    from safetensors.torch import save_file

    from dspark.quant import dequantize, quantize_fp4, quantize_fp8

    g = torch.Generator().manual_seed(0)
    stored, full = {}, {}
    for name, codec in (("layers.0.attn.wq_b.weight", "fp8"), ("layers.0.attn.wo_b.weight", "fp8"),
                        ("layers.0.ffn.experts.0.w1.weight", "fp4"), ("layers.0.ffn.experts.0.w2.weight", "fp4"),
                        ("layers.0.ffn.experts.1.w2.weight", "fp4")):
        width = 96 if name.endswith("experts.1.w2.weight") else 128  # 96 / 2 = 48: cuts a 32-block
        data, scale = (quantize_fp8(torch.randn(64, width, generator=g), (32, 32)) if codec == "fp8"
                       else quantize_fp4(torch.randn(64, width, generator=g)))
        stored[name], stored[name[:-len("weight")] + "scale"] = data, scale
        full[name] = dequantize(data, scale, (32, 32))
    save_file(stored, str(path / "model.safetensors"))
    return full


def test_quantised_slices_are_read_with_their_scale_blocks(tmp_path):
    from dspark.distributed.tp_loading import plan_split_sources
    from dspark.loader import SafetensorsReader
    from dspark.quant import FP4_BLOCK

    full = _quantised_checkpoint(tmp_path)
    with SafetensorsReader(tmp_path) as reader:
        for rank in range(2):
            sources, problems = plan_split_sources(reader, lambda key: key, (32, 32), FP4_BLOCK, rank, 2)
            assert list(problems) == ["layers.0.ffn.experts.1.w2.weight"]
            assert "cuts its fp4 scale blocks of 32" in problems["layers.0.ffn.experts.1.w2.weight"]
            for name, source in sources.items():
                axis = split_axis(name)
                want = full[name].chunk(2, dim=axis)[rank]
                assert source.shape == tuple(want.shape)
                assert torch.equal(source.read(torch.device("cpu")), want), name
