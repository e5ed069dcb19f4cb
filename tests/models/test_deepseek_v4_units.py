"""DeepSeek-V4 building blocks: spec §18.2 vectors, mHC / RoPE against HF modules, key mapping, init."""

import math

import pytest
import torch

from dspark.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, hf_keys
from dspark.models.deepseek_v4.attention import causal_entry_index, window_index
from dspark.models.deepseek_v4.compressor import Indexer
from dspark.models.deepseek_v4.config import RopeParameters
from dspark.models.deepseek_v4.mhc import hc_head, hc_post, hc_pre, split_mixes
from dspark.models.deepseek_v4.moe import sqrtsoftplus
from dspark.models.deepseek_v4.rope import Rope, _yarn_correction_range, apply_rope, inverse_frequencies

COMPRESS_ROPE = RopeParameters("yarn", 160000.0, 0.125, factor=16.0, original_max_position_embeddings=65536,
                               beta_fast=32.0, beta_slow=1.0)


# -------------------------------------------------------------------------------------------------
# Spec §18.2 analytic vectors
# -------------------------------------------------------------------------------------------------


def test_sinkhorn_split_vector():
    mixes = 2 * torch.sin(torch.arange(24, dtype=torch.float32))
    pre, post, comb = split_mixes(mixes, torch.tensor([1.0, 0.5, 2.0]), torch.zeros(24), 4, 20, 1e-6)
    expected_comb = [[0.713589, 0.266698, 0.014651, 0.001034], [0.000205, 0.035325, 0.870266, 0.097287],
                     [0.037894, 0.009638, 0.056244, 0.900776], [0.248311, 0.688339, 0.058838, 0.000902]]
    torch.testing.assert_close(pre, torch.tensor([0.500001, 0.843295, 0.860398, 0.570096]), atol=1e-6, rtol=0)
    torch.testing.assert_close(post, torch.tensor([0.638682, 0.554187, 0.861194, 1.317166]), atol=1e-6, rtol=0)
    torch.testing.assert_close(comb, torch.tensor(expected_comb), atol=1e-6, rtol=0)
    torch.testing.assert_close(comb.sum(0), torch.full((4,), 0.999999), atol=1e-6, rtol=0)
    torch.testing.assert_close(comb.sum(1), torch.tensor([0.99597, 1.00308, 1.00455, 0.99639]), atol=1e-5, rtol=0)


def test_mhc_at_init_collapses_to_twice_the_embedding():
    x = torch.randn(5, 1, 64).expand(-1, 4, -1)
    u, post, comb = hc_pre(x, torch.zeros(24, 256), torch.zeros(24), torch.ones(3), 4, 20, 1e-6, 1e-6)
    torch.testing.assert_close(post, torch.ones(5, 4))
    torch.testing.assert_close(comb, torch.full((5, 4, 4), 0.25), atol=1e-5, rtol=0)
    torch.testing.assert_close(u, 4 * (0.5 + 1e-6) * x[:, 0])  # pre ≈ 0.5 + eps per stream, not normalised


def test_sqrtsoftplus_values():
    torch.testing.assert_close(sqrtsoftplus(torch.tensor([0.0, 3.0])), torch.tensor([0.8325546, 1.7460204]))
    assert torch.isfinite(sqrtsoftplus(torch.tensor([1e4], dtype=torch.bfloat16))).all()  # no overflow


def test_yarn_inverse_frequencies():
    assert _yarn_correction_range(COMPRESS_ROPE, 64) == (15, 25)
    theta = inverse_frequencies(COMPRESS_ROPE, head_dim=512)
    assert theta.shape == (32,) and theta.dtype == torch.float32
    torch.testing.assert_close(theta[:3], torch.tensor([1.0, 0.687656, 0.472871]), atol=1e-6, rtol=0)
    torch.testing.assert_close(theta[29:], torch.tensor([1.20129e-6, 8.26071e-7, 5.68053e-7]), atol=0, rtol=1e-5)
    main = inverse_frequencies(RopeParameters("default", 10000.0, 0.125), head_dim=512)
    torch.testing.assert_close(main, 10000.0 ** (-torch.arange(32) / 32.0))


def test_visibility_rules():
    def visible(rate, p, n_entries=3):
        picks = causal_entry_index(torch.tensor([p]), n_entries, rate, offset=0)[0]
        return [int(w) for w in picks if w >= 0]

    assert visible(4, 6) == [0] and visible(4, 7) == [0, 1]
    assert visible(128, 127) == [0] and visible(128, 126) == []
    # The indexer never picks an entry the query cannot see, whatever its score.
    indexer = Indexer(dim=8, q_lora_rank=4, n_heads=2, head_dim=8, topk=4, rate=4, eps=1e-6)
    picks = indexer(torch.randn(2, 2, 8), torch.ones(2, 2), torch.randn(3, 8), torch.tensor([6, 7]))
    assert sorted(t for t in picks[0].tolist() if t >= 0) == [0]
    assert sorted(t for t in picks[1].tolist() if t >= 0) == [0, 1]
    # The window includes the query itself and the W - 1 tokens before it.
    assert window_index(torch.tensor([2, 9]), 4, first_row=0).tolist() == [[-1, 0, 1, 2], [6, 7, 8, 9]]


def test_cache_counts_after_41_tokens(model, random_ids, feed):
    state = model.new_state()
    feed(model, state, random_ids(41, seed=0))
    csa, hca = state.layers[1], state.layers[2]
    assert csa.compressor.n_entries == csa.indexer.n_entries == 10  # ⌊41/4⌋
    assert csa.compressor.rows_end - 10 * 4 == 1  # one token waits in the incomplete window
    assert hca.compressor.n_entries == 5  # ⌊41/8⌋
    live = state.snapshot(live_only=True)
    assert live["layers.0.window.latents"].shape == (7, 32)  # W - 1 past latents
    assert live["layers.1.compressor.kv_rows"].shape == (5, 64)  # previous window's "a" half + 1 row


# -------------------------------------------------------------------------------------------------
# mHC and RoPE against the HF modules
# -------------------------------------------------------------------------------------------------


def test_mhc_matches_hf_modules(hf_model):
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    site = hf_model.model.layers[1].attn_hc
    x = torch.randn(7, 4, 64)
    post, comb, collapsed = site(x[None])
    u, post2, comb2 = hc_pre(x, site.fn, site.base, site.scale, 4, 20, 1e-6, 1e-6)
    torch.testing.assert_close(u, collapsed[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(post2, post[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb2, comb[0], atol=1e-6, rtol=1e-6)
    f = torch.randn(7, 64)
    expected = post[0].unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), x)
    torch.testing.assert_close(hc_post(f, x, post2, comb2), expected, atol=1e-5, rtol=1e-5)
    head = hf_model.model.hc_head
    torch.testing.assert_close(hc_head(x, head.hc_fn, head.hc_base, head.hc_scale, 1e-6, 1e-6), head(x[None])[0],
                               atol=1e-6, rtol=1e-6)
    assert isinstance(site, modeling.DeepseekV4HyperConnection)


@pytest.mark.parametrize("flash", [False, True])
def test_rope_tables_match_hf(tiny, flash):
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    flash_rope = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1}
    d = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=128, max_position_embeddings=1048576,
             rope_scaling=flash_rope) if flash else tiny()
    config = DeepseekV4Config.from_dict(d)
    theirs = modeling.DeepseekV4RotaryEmbedding(transformers.DeepseekV4Config(**d))
    positions = torch.tensor([0, 1, 65535, 1_000_000])
    for label, layer_type in (("main", "sliding_attention"), ("compress", "compressed_sparse_attention")):
        rope = Rope(config.rope_for(layer_type), config.head_dim)
        assert torch.equal(rope.inv_freq, getattr(theirs, f"{label}_inv_freq"))
        cos, sin = rope.cos_sin(positions)
        cos_ref, sin_ref = theirs(torch.zeros(1, dtype=torch.float32), positions[None], layer_type=label)
        torch.testing.assert_close(cos, cos_ref[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, sin_ref[0], atol=1e-6, rtol=0)


def test_apply_rope_is_a_complex_rotation_of_the_trailing_dims():
    x = torch.randn(3, 2, 16)
    rope = Rope(RopeParameters("default", 10000.0, 0.5), head_dim=16)
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 40]))
    y = apply_rope(x, cos[:, None], sin[:, None])
    assert torch.equal(y[..., :8], x[..., :8])  # the "nope" dims are untouched
    z = torch.view_as_complex(x[..., 8:].reshape(3, 2, 4, 2).contiguous())
    angle = torch.tensor([0, 5, 40])[:, None, None] * rope.inv_freq
    expected = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    torch.testing.assert_close(y[..., 8:], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(y, cos[:, None], -sin[:, None]), x, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------------
# Checkpoint keys and the HF mapping
# -------------------------------------------------------------------------------------------------


def test_parameter_names_are_official_checkpoint_keys(model):
    keys = set(model.state_dict())
    for key in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
                "layers.0.attn_norm.weight", "layers.0.hc_attn_fn", "layers.0.hc_ffn_scale", "layers.0.attn.attn_sink",
                "layers.0.attn.wq_a.weight", "layers.0.attn.q_norm.weight", "layers.0.attn.wo_a.weight",
                "layers.0.ffn.gate.tid2eid", "layers.2.ffn.gate.bias", "layers.0.ffn.experts.7.w3.weight",
                "layers.0.ffn.shared_experts.w2.weight", "layers.1.attn.compressor.ape",
                "layers.1.attn.compressor.norm.weight", "layers.1.attn.indexer.wq_b.weight",
                "layers.1.attn.indexer.weights_proj.weight", "layers.1.attn.indexer.compressor.wgate.weight",
                "layers.2.attn.compressor.wkv.weight"):
        assert key in keys, key
    assert "layers.0.ffn.gate.bias" not in keys and "layers.2.ffn.gate.tid2eid" not in keys
    assert "layers.2.attn.indexer.wq_b.weight" not in keys and "layers.0.attn.compressor.ape" not in keys
    assert model.state_dict()["layers.1.attn.compressor.ape"].shape == (4, 64)  # CSA: 2 × head_dim wide
    assert model.state_dict()["layers.2.attn.compressor.ape"].shape == (8, 32)  # HCA: rate × head_dim


def test_fp32_parameters_stay_fp32_in_bf16_model(tiny):
    m = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(tiny(num_nextn_predict_layers=1)), dtype=torch.bfloat16)
    sd = m.state_dict()
    for key, t in sd.items():
        fp32 = key.endswith(("attn_sink", "ape", "gate.bias", "norm.weight")) or key.split(".")[-1].startswith("hc_")
        if key.endswith("tid2eid"):
            assert t.dtype == torch.long
        else:
            assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), key


def test_hf_keys_round_trip(hf_model, model):
    official = hf_keys.hf_to_official(hf_model.state_dict())
    assert set(official) == set(model.state_dict())
    back = hf_keys.official_to_hf(official)
    assert set(back) == set(hf_model.state_dict())
    for key, tensor in hf_model.state_dict().items():
        assert torch.equal(back[key], tensor), key


def test_hf_keys_expert_split_and_scales():
    gate_up = torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    out = hf_keys.hf_to_official({"model.layers.4.mlp.experts.gate_up_proj": gate_up,
                                  "model.layers.4.mlp.experts.down_proj_scale_inv": torch.ones(2, 3, 1),
                                  "model.layers.4.self_attn.q_a_proj.weight_scale_inv": torch.ones(1)})
    assert torch.equal(out["layers.4.ffn.experts.1.w1.weight"], gate_up[1, :3])
    assert torch.equal(out["layers.4.ffn.experts.1.w3.weight"], gate_up[1, 3:])
    assert set(out) >= {"layers.4.ffn.experts.0.w2.scale", "layers.4.attn.wq_a.scale"}
    # mHC scales are parameters, not block scales
    assert hf_keys.official_to_hf_name("layers.3.hc_attn_scale") == "model.layers.3.attn_hc.scale"
    wo_b_scale = "model.layers.3.self_attn.o_b_proj.weight_scale_inv"
    assert hf_keys.official_to_hf_name("layers.3.attn.wo_b.scale") == wo_b_scale
    assert hf_keys.hf_to_official_name(wo_b_scale) == "layers.3.attn.wo_b.scale"


def test_hf_keys_name_what_they_cannot_map():
    with pytest.raises(ValueError, match="model.layers.0.self_attn.mystery"):
        hf_keys.hf_to_official({"model.layers.0.self_attn.mystery": torch.zeros(1)})
    with pytest.raises(ValueError, match="layers.0.attn.mystery"):
        hf_keys.official_to_hf({"layers.0.attn.mystery": torch.zeros(1)})
    incomplete = {f"layers.0.ffn.experts.{e}.{w}.weight": torch.zeros(2, 2) for e in range(2) for w in ("w1", "w3")}
    incomplete["layers.0.ffn.experts.0.w2.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"layers.0.ffn.experts.1.w2.weight"):
        hf_keys.official_to_hf(incomplete)
    assert hf_keys.official_to_hf({"mtp.0.e_proj.weight": torch.zeros(1)}) == {}  # HF has no MTP block


def test_init_weights_is_seeded_and_sensitive(tiny):
    config = DeepseekV4Config.from_dict(tiny(num_nextn_predict_layers=1))
    a = DeepseekV4ForCausalLM(config).init_weights(seed=3).state_dict()
    b = DeepseekV4ForCausalLM(config).init_weights(seed=3).state_dict()
    c = DeepseekV4ForCausalLM(config).init_weights(seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq_a.weight"], c["layers.0.attn.wq_a.weight"])
    table = a["layers.0.ffn.gate.tid2eid"]
    assert table.shape == (256, 2) and (table[:, 0] != table[:, 1]).all() and table.min() >= 0 and table.max() < 8
    scales = torch.cat([a[k] for k in a if k.endswith("_scale")])
    assert scales.min() >= 0.5 and scales.max() <= 1.5
    assert a["layers.1.attn.attn_sink"].std() > 0.2 and a["layers.2.ffn.gate.bias"].abs().max() > 0
    assert math.isclose(a["layers.0.attn.wq_a.weight"].std().item(), 64**-0.5, rel_tol=0.2)
