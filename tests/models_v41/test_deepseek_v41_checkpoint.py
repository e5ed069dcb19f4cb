"""DeepSeek-V4.1 checkpoints in the released layout (spec §11): on-disk formats, sharded exact
round trips through `dspark.load_model`, ignored keys, the tokenizer-derived Engram table."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dspark
from dspark.models.deepseek_v41.checkpoint import (
    BF16,
    FP4,
    FP8,
    FP8_ROWS,
    FP32,
    disk_format,
    round_to_checkpoint_,
    save_checkpoint,
)
from dspark.models.deepseek_v41.engram_hash import build_token_map

SHARD_BYTES = 64 * 1024  # the tiny model quantised is ~0.6 MB: many shards


def disk_tensors(path):
    """{key: (safetensors dtype, shape)} over all shards."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def rounded(tiny):
    """A random tiny model (exact mode) holding exactly what a quantised checkpoint can store."""
    return round_to_checkpoint_(dspark.init_model(tiny(), seed=3, prefill_mode="exact"))


@pytest.fixture(scope="module")
def quantised_dir(rounded, tmp_path_factory):
    path = tmp_path_factory.mktemp("v41") / "quantised"
    save_checkpoint(rounded, path, quantize=True, max_shard_bytes=SHARD_BYTES)
    return path


def test_disk_formats_follow_the_release():
    expected = {
        "embed.weight": BF16, "head.weight": BF16, "norm.weight": BF16,
        "layers.1.attn_norm.weight": BF16, "layers.1.hc_attn_fn": FP32, "layers.1.hc_ffn_scale": FP32,
        "layers.1.attn.wq_a.weight": FP8, "layers.1.attn.wq_b.weight": FP8, "layers.1.attn.wkv.weight": FP8,
        "layers.1.attn.wo_a.weight": FP8, "layers.1.attn.wo_b.weight": FP8, "layers.1.attn.q_norm.weight": BF16,
        "layers.1.attn.attn_sink": FP32, "layers.1.attn.compressor.wkv.weight": BF16,
        "layers.1.attn.compressor.wgate.weight": BF16, "layers.1.attn.compressor.norm.weight": BF16,
        "layers.1.attn.indexer.wq_b.weight": FP8, "layers.1.attn.indexer.weights_proj.weight": BF16,
        "layers.1.attn.indexer.wk.weight": BF16, "layers.1.attn.indexer.k_norm.weight": BF16,
        "layers.2.ffn.gate.weight": BF16, "layers.2.ffn.gate.bias": FP32, "layers.2.ffn.gate.bias_vl": FP32,
        "layers.2.ffn.experts.7.w2.weight": FP4, "layers.2.ffn.shared_experts.w3.weight": FP8,
        "layers.1.engram.embed.weight": FP8_ROWS, "layers.1.engram.wkv.weight": FP8,
        "layers.1.engram.q_weight": BF16, "layers.1.engram.k_weight": BF16,
    }
    assert {name: disk_format(name) for name in expected} == expected


def test_quantised_checkpoint_has_the_released_layout(rounded, quantised_dir):
    files = sorted(p.name for p in quantised_dir.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    disk = disk_tensors(quantised_dir)
    model_keys = set(rounded.state_dict())
    scales = {k for k in disk if k.endswith(".scale")}
    assert set(disk) - scales == model_keys and not any(k.startswith("mtp.") for k in disk)
    assert disk["layers.1.attn.wq_b.weight"] == ("F8_E4M3", (128, 32))
    assert disk["layers.1.attn.wq_b.scale"] == ("F8_E8M0", (4, 1))  # 32 x 32 blocks
    assert disk["layers.1.attn.wo_a.scale"] == ("F8_E8M0", (1, 2))
    assert disk["layers.3.ffn.experts.0.w1.weight"] == ("I8", (32, 32))  # two FP4 codes per byte
    assert disk["layers.3.ffn.experts.0.w1.scale"] == ("F8_E8M0", (32, 2))
    assert disk["layers.4.engram.embed.weight"] == ("F8_E4M3", (630, 32))
    assert disk["layers.4.engram.embed.scale"] == ("F8_E8M0", (630, 1))  # one scale per 32 row values
    assert disk["layers.4.engram.wkv.scale"] == ("F8_E8M0", (10, 6))
    assert disk["layers.0.hc_attn_scale"] == ("F32", (3,)) and disk["layers.0.ffn.gate.bias_vl"] == ("F32", (8,))
    assert disk["embed.weight"] == ("BF16", (258, 64)) and disk["layers.6.attn.indexer.wq_b.weight"][0] == "F8_E4M3"
    config = json.loads((quantised_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["text_config"]["model_type"] == "deepseek_v41_text"
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                             "expert_dtype": "fp4"}


def test_quantised_round_trip_is_exact(rounded, quantised_dir, random_ids):
    loaded = dspark.load_model(quantised_dir, prefill_mode="exact")
    assert loaded.tokenizer is None and not loaded.training and loaded.dspark is None
    mine, theirs = rounded.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = random_ids(41, seed=0)
    assert torch.equal(rounded(ids, [rounded.new_state()], [41]).logits, loaded(ids, [loaded.new_state()], [41]).logits)


def test_plain_round_trip_is_exact(tiny, tmp_path):
    model = dspark.init_model(tiny(), seed=4)
    save_checkpoint(model, tmp_path, quantize=False, max_shard_bytes=SHARD_BYTES)
    assert disk_tensors(tmp_path)["layers.1.attn.wq_a.weight"][0] == "F32"
    loaded = dspark.load_model(tmp_path)
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in model.state_dict().items())


def test_drafter_and_vision_keys_are_ignored_missing_keys_are_named(quantised_dir, tmp_path):
    path = shutil.copytree(quantised_dir, tmp_path / "copy")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"]["embed.weight"]
    tensors = load_file(str(shard))
    # Stray `mtp.*` tensors without stage 0's `main_proj` are no DSpark stages: ignored by the target.
    extra = {"mtp.1.attn.wq_a.weight": torch.zeros(2, 2), "vision.patch.weight": torch.zeros(2),
             "aligner.w1.weight": torch.zeros(2), "image_newline": torch.zeros(2)}
    save_file({**tensors, **extra}, str(shard))
    for key in extra:
        index["weight_map"][key] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    dspark.load_model(path)  # loads: those keys belong to the drafter and the vision tower

    del tensors["embed.weight"]
    save_file({**tensors, **extra}, str(shard))
    with pytest.raises(ValueError, match=r"missing keys \(1\):\n    embed.weight"):
        dspark.load_model(path)


def test_tokenizer_in_the_directory_is_bound(tiny, tmp_path, bpe_tokenizer):
    tokenizer = bpe_tokenizer()
    token_map, n_compressed = build_token_map(tokenizer)
    save_checkpoint(dspark.init_model(tiny(), seed=5), tmp_path / "wrong", quantize=False)
    tokenizer.save(str(tmp_path / "wrong" / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"engram_compressed_vocab_size: 258 but the tokenizer gives {n_compressed}"):
        dspark.load_model(tmp_path / "wrong")
    save_checkpoint(dspark.init_model(tiny(engram_compressed_vocab_size=n_compressed), seed=5), tmp_path / "right",
                    quantize=False)
    tokenizer.save(str(tmp_path / "right" / "tokenizer.json"))
    model = dspark.load_model(tmp_path / "right")
    assert model.engram_token_map[: len(token_map)].tolist() == token_map
    assert model.tokenizer.encode("hello world").ids == tokenizer.encode("hello world").ids
