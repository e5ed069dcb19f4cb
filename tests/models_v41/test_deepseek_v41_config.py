"""`DeepseekV41Config`: the released config.json (spec §2.1), the CSA2 schedule (§2.3), derivation
defaults and validation rules (§2.4)."""

import pytest

from dspark.models.deepseek_v41 import DeepseekV41Config
from dspark.models.deepseek_v41.config import default_compress_ratios


def test_released_config_schedule_and_values(released_config):
    c = DeepseekV41Config.from_dict(released_config())
    kinds = [r.kind for r in c.layer_roles]
    assert {k: kinds.count(k) for k in set(kinds)} == {"full": 4, "reindex": 4, "reuse": 30, "swa": 2}
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    roles = c.layer_roles
    assert (roles[7].kv_source, roles[7].index_source) == (2, 2)  # layer 7 reads layer 2
    assert (roles[27].kv_source, roles[27].index_source) == (20, 24)  # reads 20's KV, 24's top-k
    assert [r.layer_id for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.layer_id for r in roles if r.is_candidate_source] == [20]
    assert [r.layer_id for r in roles if r.has_engram] == [1, 14]
    assert [r.rope for r in roles[:3]] == ["main", "main", "compress"] and roles[39].rope == "compress"
    assert roles[2].owns_compressor and roles[2].owns_indexer and not roles[24].owns_compressor
    assert c.compress_ratios == tuple([0, 0] + [2] * 18 + [1] * 20)  # the 3 DSpark-stage zeros dropped
    assert (c.rms_norm_eps, c.hc_eps, c.gate_temp, c.n_routed_experts, c.num_experts_per_tok) == (1e-20, 1e-6, 1.0,
                                                                                                  384, 6)
    assert (c.engram_pad_id, c.image_token_id, c.quantization_config["weight_block_size"]) == (2, 129264, [32, 32])
    assert c.replay_split_layer == 20 and c.dspark_target_layer_ids == (37, 38, 39)
    compress = c.rope_for(20)
    assert (compress.rope_type, compress.rope_theta, compress.factor, compress.attention_factor) == ("yarn", 160000,
                                                                                                     16, 1.0)
    assert c.rope_for(0).rope_type == "default" and c.rope_for(0).rope_theta == 10000


def test_round_trip_and_flat_form(released_config):
    c = DeepseekV41Config.from_dict(released_config())
    d = c.to_dict()
    assert d["model_type"] == "deepseek_v41" and d["text_config"]["model_type"] == "deepseek_v41_text"
    assert DeepseekV41Config.from_dict(d) == c
    flat = dict(released_config()["text_config"], image_token_id=129264)
    assert DeepseekV41Config.from_dict(flat).layer_roles == c.layer_roles


def test_schedule_defaults_when_absent(tiny):
    d = tiny()
    for key in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id"):
        del d["text_config"][key]
    c = DeepseekV41Config.from_dict(d)
    assert list(c.compress_ratios) == default_compress_ratios(7) == [0, 0, 2, 2, 1, 1, 1]
    assert c.kv_source_layer_ids == (2, 4) and c.index_source_layer_ids == (2, 4)
    assert c.candidate_source_layer_id == 4 and c.replay_split_layer == 4
    assert default_compress_ratios(40) == [0, 0] + [2] * 18 + [1] * 20
    assert default_compress_ratios(2) == [0, 0] and default_compress_ratios(3) == [0, 0, 1]
    d["text_config"]["candidate_source_layer_id"] = -1  # disables the second level
    assert not any(r.is_candidate_source or r.uses_candidates for r in DeepseekV41Config.from_dict(d).layer_roles)


@pytest.mark.parametrize("overrides, message", [
    (dict(kv_source_layer_ids=[0, 4]), r"kv_source_layer_ids: layers \[0\] have compress_ratios 0"),
    (dict(kv_source_layer_ids=[4]), r"compress_ratios\[1\]: 2 but no kv_source_layer_ids entry at or before layer 1"),
    (dict(index_source_layer_ids=[4, 6]), r"index_source_layer_ids: \[4, 6\] has no entry in \[1, 1\] for layer 1"),
    (dict(index_source_layer_ids=[1, 5, 6]), r"has no entry in \[4, 4\] for layer 4"),
    (dict(candidate_source_layer_id=5), r"candidate_source_layer_id: 5 must be one of index_source_layer_ids"),
    (dict(kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 6], candidate_source_layer_id=1),
     r"compress_ratios\[4\]: 1 differs from its KV source layer 3 \(ratio 2\)"),
    (dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1, 0, 1]), r"the DSpark stages are sliding-window only"),
    (dict(compress_ratios=[0, 2, 2, 1]), r"compress_ratios: 4 entries; expected num_hidden_layers=7"),
    (dict(compress_ratios=[0, 2, 2, 2, 1, 1, -1]), r"compress_ratios\[6\]: -1 must be an int >= 0"),
    (dict(kv_source_layer_ids=[4, 1]), r"kv_source_layer_ids: \[4, 1\] must be increasing"),
    (dict(engram_num_embeddings=[462, 631]), r"engram_num_embeddings: \[462, 631\] must equal the prime table "
                                             r"sizes \[462, 630\]"),
    (dict(engram_layer_ids=[1, 9], engram_num_embeddings=None), r"engram_layer_ids: \[1, 9\] must be distinct"),
    (dict(num_hash_layers=3), r"num_hash_layers: 3; DeepSeek-V4.1 has no hash-routed layers"),
    (dict(head_dim=40), r"head_dim: 40 must be a multiple of 32"),
    (dict(index_head_dim=48), r"index_head_dim: 48 must be a multiple of 32"),
    (dict(gate_temp=0), r"gate_temp: 0 must be > 0"),
    (dict(o_groups=3), r"o_groups: 3 must divide num_attention_heads=4"),
    (dict(hidden_size=None), r"missing required key\(s\) \['hidden_size'\]"),
])
def test_inconsistent_configs_are_named(tiny, overrides, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV41Config.from_dict(tiny(**overrides))


def test_candidate_consumer_reading_another_source_is_rejected(tiny):
    # Layer 6 would be an index source after the candidate source 4 but read KV source 5's entries.
    d = tiny(compress_ratios=[0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 4, 5], index_source_layer_ids=[1, 4, 5, 6])
    with pytest.raises(ValueError, match=r"layers \[5, 6\] come after candidate_source_layer_id 4 but read another"):
        DeepseekV41Config.from_dict(d)


def test_model_type_is_checked(tiny):
    with pytest.raises(ValueError, match="model_type: expected 'deepseek_v41', got 'deepseek_v4'"):
        DeepseekV41Config.from_dict({**tiny(), "model_type": "deepseek_v4"})
