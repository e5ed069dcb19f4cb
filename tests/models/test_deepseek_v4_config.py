"""`DeepseekV4Config`: legacy keys folded like HF 5.23, RoPE resolution, validation errors."""

import dataclasses

import pytest

from dspark.models.deepseek_v4 import DeepseekV4Config
from dspark.models.deepseek_v4.config import CSA, HCA, SLIDING

# The released V4-Flash config.json, as far as the model reads it (spec §2.2), legacy keys included.
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
    "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "swiglu_limit": 10.0, "num_hash_layers": 3,
    "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "expert_dtype": "fp4",
    "dspark_block_size": 5,  # unknown to the model: ignored
}


def flash(**changes):
    d = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v) for k, v in FLASH.items()}
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def test_flash_legacy_keys_fold_into_modern_fields():
    c = DeepseekV4Config.from_dict(flash())
    assert len(c.layer_types) == 43  # the trailing MTP entry of compress_ratios is dropped
    assert c.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and c.layer_types[-1] == CSA
    assert (c.layer_types.count(SLIDING), c.layer_types.count(CSA), c.layer_types.count(HCA)) == (2, 21, 20)
    assert c.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 40
    assert c.qk_rope_head_dim == 64 and c.partial_rotary_factor == 0.125
    assert c.rope_parameters["main"].rope_type == "default" and c.rope_parameters["main"].rope_theta == 10000
    compress = c.rope_parameters["compress"]
    assert (compress.rope_type, compress.rope_theta, compress.factor) == ("yarn", 160000, 16)
    assert compress.attention_factor == 1.0  # no YaRN mscale
    assert c.rope_for(HCA) is compress and c.rope_for(SLIDING) is c.rope_parameters["main"]
    assert c.quantization_config["expert_dtype"] == "fp4" and c.quantization_config["weight_block_size"] == [128, 128]
    assert c.compress_rate(CSA) == 4 and c.compress_rate(HCA) == 128 and c.compress_rate(SLIDING) == 0


def test_resolution_agrees_with_hf_config():
    transformers = pytest.importorskip("transformers")
    ours = DeepseekV4Config.from_dict(flash(dspark_block_size=None))
    theirs = transformers.DeepseekV4Config(**flash(dspark_block_size=None))
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.compress_rates == theirs.compress_rates
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim
    for label in ("main", "compress"):
        hf = theirs.rope_parameters[label]
        mine = ours.rope_parameters[label]
        assert (mine.rope_type, mine.rope_theta, mine.partial_rotary_factor) == (
            hf["rope_type"], hf["rope_theta"], hf["partial_rotary_factor"])
        if mine.rope_type == "yarn":
            assert (mine.factor, mine.original_max_position_embeddings, mine.beta_fast, mine.beta_slow,
                    mine.attention_factor) == (hf["factor"], hf["original_max_position_embeddings"], hf["beta_fast"],
                                               hf["beta_slow"], hf["attention_factor"])


def test_pro_schedule_and_legacy_rates():
    ratios = [128, 128] + [4 if i % 2 == 0 else 128 for i in range(59)] + [0]
    c = DeepseekV4Config.from_dict(flash(num_hidden_layers=61, compress_ratios=ratios))
    assert c.layer_types[:4] == (HCA, HCA, CSA, HCA) and len(c.layer_types) == 61
    c = DeepseekV4Config.from_dict(flash(compress_ratios=[0, 8] * 21 + [8], compress_rate_hca=8))
    assert c.compress_rates[HCA] == 8 and c.layer_types[1] == HCA


def test_without_rope_scaling_the_compress_rope_is_plain():
    c = DeepseekV4Config.from_dict(flash(rope_scaling=None))
    assert c.rope_parameters["compress"].rope_type == "default" and c.rope_parameters["compress"].rope_theta == 160000


def test_round_trips_through_to_dict_and_is_frozen():
    c = DeepseekV4Config.from_dict(flash())
    assert DeepseekV4Config.from_dict(c.to_dict()) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 8


def test_from_json_reads_a_directory(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(flash()))
    assert DeepseekV4Config.from_json(tmp_path).num_hidden_layers == 43


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_size": None}, r"missing required key\(s\) \['hidden_size'\]"),
        ({"compress_ratios": None}, "layer_types"),
        ({"compress_ratios": None, "layer_types": [SLIDING] * 42},
         r"layer_types: .* has 42 entries, num_hidden_layers is 43"),
        ({"compress_ratios": None, "layer_types": [SLIDING] * 42 + ["dense"]},
         r"layer_types\[42\]: 'dense' is not one of"),
        ({"mlp_layer_types": ["moe"] * 42 + ["hash"]}, r"mlp_layer_types\[42\]: 'hash'"),
        ({"compress_ratios": [0, 0, 16] + [4] * 41}, r"compress_ratios\[2\]: 16"),
        ({"o_groups": 7}, r"o_groups: 7 must divide num_attention_heads=64"),
        ({"num_experts_per_tok": 300}, r"num_experts_per_tok: 300 exceeds n_routed_experts=256"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads: 2"),
        ({"scoring_func": "relu"}, r"scoring_func: 'relu'"),
        ({"qk_rope_head_dim": 63}, r"partial_rotary_factor"),
        ({"rope_scaling": {"type": "longrope", "factor": 2}}, r"rope_type: 'longrope'"),
        ({"model_type": "deepseek_v3"}, r"model_type: expected 'deepseek_v4', got 'deepseek_v3'"),
        ({"sliding_window": 0}, r"sliding_window: 0 must be a positive int"),
        ({"compress_rates": {"sparse": 4}}, r"compress_rates: unknown layer type"),
    ],
)
def test_invalid_configs_name_the_field_and_value(changes, match):
    with pytest.raises(ValueError, match=match):
        DeepseekV4Config.from_dict(flash(**changes))
