"""The generic loader on a toy module: sharding, quantised pairs, and error reporting."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dspark.loader import SafetensorsReader, checkpoint_files, load_tensors, plan_sources
from dspark.quant import FP4_BLOCK, dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

FP8_BLOCK = (32, 32)


class Toy(torch.nn.Module):
    """An FP8 linear, an FP4 expert, a norm, and an mHC-style `*_scale` parameter."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(70, 40, bias=False)
        self.expert = torch.nn.Linear(64, 16, bias=False)
        self.norm = torch.nn.LayerNorm(70, bias=False)
        self.hc_attn_scale = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("tid2eid", torch.zeros(5, 2, dtype=torch.int64))


def toy_disk_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    proj, proj_scale = quantize_fp8(torch.randn(40, 70, generator=g), FP8_BLOCK)
    expert, expert_scale = quantize_fp4(torch.randn(16, 64, generator=g))
    return {
        "proj.weight": proj,
        "proj.scale": proj_scale,
        "expert.weight": expert,
        "expert.scale": expert_scale,
        "norm.weight": torch.rand(70, generator=g).to(torch.bfloat16) + 0.5,
        "hc_attn_scale": torch.rand(3, generator=g) + 0.5,
        "tid2eid": torch.randint(0, 8, (5, 2), generator=g, dtype=torch.int32),
    }


def write_sharded(path, tensors, shards):
    """Write `tensors` round-robin into `shards` files plus an index."""
    path.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {key: names[i % shards] for i, key in enumerate(tensors)}
    for name in names:
        save_file({k: v for k, v in tensors.items() if weight_map[k] == name}, str(path / name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def load_toy(path, model=None, rename=lambda key: key):
    model = model or Toy()
    with SafetensorsReader(path) as reader:
        sources, problems = plan_sources(reader, rename, FP8_BLOCK, FP4_BLOCK)
        load_tensors(model.state_dict(keep_vars=True), sources, problems=problems, where=str(path))
    return model


def test_sharded_checkpoint_loads_dequantised(tmp_path):
    disk = toy_disk_tensors()
    write_sharded(tmp_path, disk, shards=3)
    assert len(checkpoint_files(tmp_path)) == 3
    model = load_toy(tmp_path)
    assert torch.equal(model.proj.weight, dequantize_fp8(disk["proj.weight"], disk["proj.scale"], FP8_BLOCK))
    assert torch.equal(model.expert.weight, dequantize_fp4(disk["expert.weight"], disk["expert.scale"]))
    assert torch.equal(model.norm.weight, disk["norm.weight"].float())
    # An mHC `*_scale` is an ordinary parameter, never consumed as a block scale.
    assert torch.equal(model.hc_attn_scale, disk["hc_attn_scale"])
    assert model.tid2eid.dtype == torch.int64 and torch.equal(model.tid2eid, disk["tid2eid"].long())


def test_single_file_checkpoint_and_parameter_dtypes_are_kept(tmp_path):
    disk = toy_disk_tensors(seed=1)
    save_file(disk, str(tmp_path / "model.safetensors"))
    model = Toy().to(torch.bfloat16)
    model.hc_attn_scale.data = model.hc_attn_scale.data.float()  # an fp32-kept parameter
    load_toy(tmp_path, model)
    assert model.proj.weight.dtype == torch.bfloat16
    assert model.hc_attn_scale.dtype == torch.float32 and torch.equal(model.hc_attn_scale, disk["hc_attn_scale"])


def test_renamed_and_ignored_keys(tmp_path):
    disk = toy_disk_tensors(seed=2)
    disk = {("model." + k if k != "tid2eid" else k): v for k, v in disk.items()}
    disk["model.copy_of_embedding"] = torch.ones(2)
    save_file(disk, str(tmp_path / "model.safetensors"))

    def rename(key):
        return None if key == "model.copy_of_embedding" else key.removeprefix("model.")

    model = load_toy(tmp_path, rename=rename)
    assert torch.equal(model.hc_attn_scale, disk["model.hc_attn_scale"])


def test_all_problems_reported_in_one_error(tmp_path):
    disk = toy_disk_tensors(seed=3)
    del disk["norm.weight"]  # missing
    disk["stray.weight"] = torch.ones(4)  # unexpected
    disk["hc_attn_scale"] = torch.ones(4)  # wrong shape
    del disk["expert.scale"]  # FP4 weight without its scale
    save_file(disk, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        load_toy(tmp_path)
    message = str(info.value)
    # The FP4 weight is on disk, so it is reported for its scale, not as missing.
    assert "missing keys (1):\n    norm.weight\n" in message
    assert "unexpected keys (1)" in message and "stray.weight" in message
    assert "hc_attn_scale: expected (3,), found (4,)" in message
    assert "expert.weight: I8 weight without its block scale expert.scale" in message


def test_wrong_scale_grid_is_reported(tmp_path):
    disk = toy_disk_tensors(seed=4)
    disk["proj.scale"] = disk["proj.scale"][:, :2].contiguous()
    save_file(disk, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"proj.scale: scale shape \(2, 2\) .* expected \(2, 3\)"):
        load_toy(tmp_path)


def test_missing_shard_is_named(tmp_path):
    write_sharded(tmp_path, toy_disk_tensors(), shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
        checkpoint_files(tmp_path)


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        checkpoint_files(tmp_path)
