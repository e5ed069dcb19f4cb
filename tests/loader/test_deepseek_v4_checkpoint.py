"""Official-layout DeepSeek-V4 checkpoints: on-disk formats, exact round trips, error reporting."""

import json
import shutil
from importlib import resources

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dspark.api as api
from dspark.models.deepseek_v4.checkpoint import (
    BF16,
    FP4,
    FP8,
    FP32,
    INT64,
    disk_format,
    round_to_checkpoint_,
    save_checkpoint,
)

# Small enough that the tiny model (about 0.9 MB quantised) spreads over many shards.
SHARD_BYTES = 96 * 1024


def tiny_config():
    """Spec §18.1's tiny architecture-complete config (16 indexer heads), as shipped in dspark."""
    return json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())


def logits(model, ids):
    return model(ids, [model.new_state()], [len(ids)]).logits


@pytest.fixture(scope="module")
def rounded_model():
    """A random tiny model whose weights are exactly what a quantised checkpoint can hold."""
    return round_to_checkpoint_(api.init_model(tiny_config(), seed=3))


@pytest.fixture(scope="module")
def quantised_dir(rounded_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("v4") / "quantised"
    save_checkpoint(rounded_model, path, quantize=True, max_shard_bytes=SHARD_BYTES)
    return path


@pytest.fixture
def ids():
    return torch.randint(0, tiny_config()["vocab_size"], (41,), generator=torch.Generator().manual_seed(0))


def disk_tensors(path):
    """{key: (safetensors dtype, shape)} over all shards."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    return out


def edit_shard_holding(path, key, edit):
    """Apply `edit(tensors)` to the shard that stores `key` and rewrite it."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    file = path / weight_map[key]
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


@pytest.fixture
def broken_dir(quantised_dir, tmp_path):
    """A private copy of the quantised checkpoint for a test to damage."""
    return shutil.copytree(quantised_dir, tmp_path / "copy")


def test_disk_formats_follow_the_release():
    expected = {
        "embed.weight": BF16,
        "head.weight": BF16,
        "norm.weight": BF16,
        "hc_head_fn": FP32,
        "hc_head_scale": FP32,
        "layers.1.attn_norm.weight": BF16,
        "layers.1.hc_attn_scale": FP32,
        "layers.1.hc_ffn_base": FP32,
        "layers.1.attn.wq_a.weight": FP8,
        "layers.1.attn.wq_b.weight": FP8,
        "layers.1.attn.wkv.weight": FP8,
        "layers.1.attn.wo_a.weight": FP8,
        "layers.1.attn.wo_b.weight": FP8,
        "layers.1.attn.q_norm.weight": BF16,
        "layers.1.attn.kv_norm.weight": BF16,
        "layers.1.attn.attn_sink": FP32,
        "layers.1.attn.compressor.wkv.weight": BF16,
        "layers.1.attn.compressor.wgate.weight": BF16,
        "layers.1.attn.compressor.ape": FP32,
        "layers.1.attn.compressor.norm.weight": BF16,
        "layers.1.attn.indexer.wq_b.weight": FP8,
        "layers.1.attn.indexer.weights_proj.weight": BF16,
        "layers.1.attn.indexer.compressor.wkv.weight": BF16,
        "layers.1.attn.indexer.compressor.ape": FP32,
        "layers.0.ffn.gate.tid2eid": INT64,
        "layers.2.ffn.gate.weight": BF16,
        "layers.2.ffn.gate.bias": FP32,
        "layers.2.ffn.experts.7.w2.weight": FP4,
        "layers.2.ffn.shared_experts.w3.weight": FP8,
        "mtp.0.e_proj.weight": FP8,
        "mtp.0.h_proj.weight": FP8,
        "mtp.0.enorm.weight": BF16,
        "mtp.0.hc_head_base": FP32,
        "mtp.0.ffn.experts.0.w1.weight": FP4,
    }
    assert {name: disk_format(name) for name in expected} == expected


def test_quantised_checkpoint_has_the_official_layout(rounded_model, quantised_dir):
    files = sorted(p.name for p in quantised_dir.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((quantised_dir / "model.safetensors.index.json").read_text())
    disk = disk_tensors(quantised_dir)
    assert set(index["weight_map"]) == set(disk)
    config = json.loads((quantised_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["expert_dtype"] == "fp4"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    # Shapes from the tiny config: D = 64, I = 32, q_lora 16, 16 indexer heads x 16.
    assert disk["layers.1.attn.wq_b.weight"] == ("F8_E4M3", (128, 16))
    assert disk["layers.1.attn.wq_b.scale"] == ("F8_E8M0", (1, 1))
    assert disk["layers.1.attn.indexer.wq_b.scale"] == ("F8_E8M0", (2, 1))
    assert disk["layers.3.ffn.experts.5.w1.weight"] == ("I8", (32, 32))
    assert disk["layers.3.ffn.experts.5.w1.scale"] == ("F8_E8M0", (32, 2))
    assert disk["layers.3.ffn.experts.5.w2.scale"] == ("F8_E8M0", (64, 1))
    assert disk["layers.1.attn.compressor.wkv.weight"] == ("BF16", (64, 64))
    assert disk["layers.1.hc_attn_scale"] == ("F32", (3,))
    assert disk["layers.0.ffn.gate.tid2eid"] == ("I64", (258, 2))
    assert disk["mtp.0.e_proj.weight"][0] == "F8_E4M3" and "mtp.0.e_proj.scale" in disk
    # Every model tensor is on disk; the only extra keys are block scales.
    names = set(rounded_model.state_dict())
    assert names <= set(disk) and all(k.endswith(".scale") for k in set(disk) - names)


def test_quantised_round_trip_is_exact(rounded_model, quantised_dir, ids):
    loaded = api.load_model(quantised_dir)
    assert loaded.has_mtp and loaded.tokenizer is None and not loaded.training
    expected = rounded_model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert torch.equal(logits(loaded, ids), logits(rounded_model, ids))


def test_unquantised_round_trip_is_exact(tmp_path, ids):
    model = api.init_model(tiny_config(), seed=4)
    save_checkpoint(model, tmp_path, quantize=False, max_shard_bytes=SHARD_BYTES)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert disk_tensors(tmp_path)["layers.1.attn.wq_a.weight"] == ("F32", (16, 64))
    loaded = api.load_model(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_bf16_load_keeps_fp32_parameters(quantised_dir, rounded_model):
    loaded = api.load_model(quantised_dir, dtype=torch.bfloat16)
    assert loaded.state_dict()["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    for name in ("layers.1.attn.attn_sink", "layers.1.hc_attn_fn", "hc_head_scale", "layers.2.ffn.gate.bias"):
        assert torch.equal(loaded.state_dict()[name], rounded_model.state_dict()[name]), name


def test_checkpoint_without_mtp_leaves_it_initialised(broken_dir, rounded_model, ids):
    mtp_keys = [k for k in disk_tensors(broken_dir) if k.startswith("mtp.")]
    for key in mtp_keys:
        edit_shard_holding(broken_dir, key, lambda t, key=key: t.pop(key))
    loaded = api.load_model(broken_dir)
    assert not loaded.has_mtp
    assert torch.equal(logits(loaded, ids), logits(rounded_model, ids))
    # What has never been loaded is not written back as if it were trained.
    save_checkpoint(loaded, broken_dir / "again", max_shard_bytes=SHARD_BYTES)
    assert not any(k.startswith("mtp.") for k in disk_tensors(broken_dir / "again"))


def test_partial_mtp_is_an_error(broken_dir):
    edit_shard_holding(broken_dir, "mtp.0.hnorm.weight", lambda t: t.pop("mtp.0.hnorm.weight"))
    with pytest.raises(ValueError, match=r"missing keys \(1\):\s+mtp.0.hnorm.weight"):
        api.load_model(broken_dir)


def test_ignored_export_keys_and_int32_routing_table(broken_dir, rounded_model):
    def edit(tensors):
        tensors["mtp.0.head.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
        tensors["layers.0.ffn.gate.tid2eid"] = tensors["layers.0.ffn.gate.tid2eid"].int()

    edit_shard_holding(broken_dir, "layers.0.ffn.gate.tid2eid", edit)
    loaded = api.load_model(broken_dir)
    table = loaded.state_dict()["layers.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int64 and torch.equal(table, rounded_model.state_dict()["layers.0.ffn.gate.tid2eid"])


# --- errors: each message names the bad key or value --------------------------------------------


def test_missing_tensor_is_named(broken_dir):
    key = "layers.3.attn.wq_a.weight"
    edit_shard_holding(broken_dir, key, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=r"missing keys \(1\):\s+layers.3.attn.wq_a.weight"):
        api.load_model(broken_dir)


def test_extra_tensor_is_named(broken_dir):
    key = "layers.3.attn.wq_a.weight"
    edit_shard_holding(broken_dir, key, lambda t: t.update({"layers.3.attn.bogus": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected keys \(1\):\s+layers.3.attn.bogus"):
        api.load_model(broken_dir)


def test_wrong_shape_is_named_with_both_shapes(broken_dir):
    key = "layers.0.attn_norm.weight"
    edit_shard_holding(broken_dir, key, lambda t: t.update({key: torch.ones(65, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match=r"layers.0.attn_norm.weight: expected \(64,\), found \(65,\)"):
        api.load_model(broken_dir)


def test_missing_block_scale_is_named(broken_dir):
    key = "layers.2.ffn.shared_experts.w1.scale"
    edit_shard_holding(broken_dir, key, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=r"layers.2.ffn.shared_experts.w1.weight: F8_E4M3 weight without .*w1.scale"):
        api.load_model(broken_dir)


def test_duplicate_experts_in_routing_table_are_named(broken_dir):
    key = "layers.1.ffn.gate.tid2eid"

    def edit(tensors):
        tensors[key][7] = torch.tensor([3, 3])

    edit_shard_holding(broken_dir, key, edit)
    with pytest.raises(ValueError, match="layers.1.ffn.gate.tid2eid: some tokens are routed twice"):
        api.load_model(broken_dir)


def test_missing_shard_is_named(broken_dir):
    second = sorted(broken_dir.glob("model-*.safetensors"))[1]
    second.unlink()
    with pytest.raises(ValueError, match=r"missing shard file\(s\): model-00002-of-"):
        api.load_model(broken_dir)
