"""The DSpark stages a DeepSeek-V4.1 checkpoint ships (`mtp.0..2`, deepseek_v41 spec §9) as the
model's drafter: shipped names, loading from a quantised checkpoint, greedy exactness, pure propose."""

import re

import pytest
import torch

import dspark
from dspark.draft import DSparkDrafter, resolve_drafter
from dspark.draft.dspark_v4 import DSparkModel
from dspark.draft.io import add_to_checkpoint, v41_dspark_config
from dspark.draft.stages import DSparkStage
from dspark.draft.stages_v41 import DSparkStageV41
from dspark.models.deepseek_v41.checkpoint import round_to_checkpoint_, save_checkpoint

DSPARK = dict(dspark_block_size=5, dspark_noise_token_id=257, dspark_target_layer_ids=[4, 5, 6],
              dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)
D, HC, V, R = 64, 4, 258, 16
# The shipped key patterns of one stage (spec §11: same block names as a layer, 128 experts).
STAGE_KEYS = (r"attn\.(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b)\.weight", r"attn\.attn_sink",
              r"(attn|ffn)_norm\.weight", r"hc_(attn|ffn)_(fn|base|scale)", r"ffn\.gate\.(weight|bias|bias_vl)",
              r"ffn\.experts\.[0-3]\.w[123]\.weight", r"ffn\.shared_experts\.w[123]\.weight")
EXTRA_KEYS = {0: (r"main_proj\.weight", r"main_norm\.weight"),
              2: (r"norm\.weight", r"markov_head\.(embed|head)\.weight", r"confidence_head\.proj\.weight")}
PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 7],
           [65, 66, 67, 65, 66, 67, 65, 66])


def _shipped(target, seed=5):
    config = v41_dspark_config(target.config)
    model = DSparkModel(config, target.config, dtype=target.dtype, device=target.device, stage_kind="shipped",
                        cache_qat=target.cache_qat).init_weights(seed).eval()
    return DSparkDrafter(target, config, model)


@pytest.fixture(scope="module")
def target(tiny):
    return dspark.init_model(tiny(**DSPARK), seed=3, prefill_mode="exact", cache_qat=False)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    """A quantised V4.1 checkpoint with its stages, and the (rounded) drafter written into it."""
    path = tmp_path_factory.mktemp("v41-dspark") / "ckpt"
    target = round_to_checkpoint_(dspark.init_model(tiny(**DSPARK), seed=3, prefill_mode="exact", cache_qat=False))
    save_checkpoint(target, path, quantize=True)
    drafter = _shipped(target)
    round_to_checkpoint_(drafter.model)  # what a quantised checkpoint can hold
    add_to_checkpoint(drafter, path, quantize=True)
    return path, drafter


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return dspark.load_model(checkpoint[0], prefill_mode="exact", cache_qat=False)


def test_stage_names_and_shapes_are_the_shipped_keys(target):
    model = _shipped(target).model
    state = model.state_dict()
    assert model.stage_kind == "shipped" and all(isinstance(s, DSparkStageV41) for s in model.mtp)
    for key in state:
        m = re.fullmatch(r"mtp\.(\d)\.(.+)", key)
        assert m, key
        patterns = STAGE_KEYS + EXTRA_KEYS.get(int(m[1]), ())
        assert any(re.fullmatch(p, m[2]) for p in patterns), key
    for i in range(3):
        for leaf in ("attn.wq_a.weight", "attn.q_norm.weight", "attn.attn_sink", "ffn.gate.bias_vl",
                     "ffn.experts.3.w2.weight", "ffn.shared_experts.w1.weight", "hc_attn_fn", "hc_ffn_scale"):
            assert f"mtp.{i}.{leaf}" in state
        assert state[f"mtp.{i}.hc_attn_fn"].shape == ((2 + HC) * HC, HC * D)
        assert state[f"mtp.{i}.hc_ffn_scale"].shape == (3,)
        assert state[f"mtp.{i}.ffn.gate.weight"].shape == (4, D)
        assert not model.mtp[i].attn.q_head_norm and model.mtp[i].attn.ratio == 0
        assert model.mtp[i].attn.compressor is None and model.mtp[i].attn.indexer is None
        assert model.mtp[i].ffn.gate.top_k == 2
    expected = {"mtp.0.main_proj.weight": (D, 3 * D), "mtp.0.main_norm.weight": (D,), "mtp.2.norm.weight": (D,),
                "mtp.2.markov_head.embed.weight": (V, R), "mtp.2.markov_head.head.weight": (V, R),
                "mtp.2.confidence_head.proj.weight": (1, D + R)}
    for name, shape in expected.items():
        assert tuple(state[name].shape) == shape, name
    assert not any(k for k in state if "hc_head" in k or "engram" in k or k.startswith(("mtp.1.main", "mtp.0.norm")))


def test_default_stage_kind_keeps_v4_stages(target):
    # Drafters trained by us (e.g. the embedded dspark-tiny's) stay V4 blocks for a V4.1 target.
    model = DSparkModel(v41_dspark_config(target.config), target.config)
    assert all(isinstance(s, DSparkStage) for s in model.mtp) and "mtp.2.hc_head_fn" in model.state_dict()


def test_quantised_checkpoint_loads_its_stages_as_the_drafter(checkpoint, loaded):
    path, drafter = checkpoint
    assert isinstance(loaded.dspark, DSparkDrafter) and loaded.dspark.target is loaded
    assert loaded.dspark.model.stage_kind == "shipped" and loaded.dspark.config == drafter.config
    assert loaded.dspark.block_size == 5 and loaded.dspark.capture_layers == (4, 5, 6)
    assert resolve_drafter(loaded, None) is loaded.dspark
    a, b = loaded.dspark.model.state_dict(), drafter.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # MXFP8 / FP4 decoded exactly
    from safetensors import safe_open

    with safe_open(str(path / "model-dspark.safetensors"), "pt") as f:
        assert f.get_tensor("mtp.0.main_proj.weight").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor("mtp.0.main_proj.scale").shape) == (D // 32, 3 * D // 32)
        assert f.get_tensor("mtp.1.attn.wq_b.weight").dtype == torch.float8_e4m3fn


def test_greedy_speculative_with_the_shipped_stages_equals_plain(loaded):
    for prompt in PROMPTS:
        plain = dspark.generate(loaded, prompt, max_new_tokens=12).token_ids
        assert dspark.generate(loaded, prompt, max_new_tokens=12, draft_tokens=5).token_ids == plain


def test_propose_leaves_the_state_unchanged(loaded):
    drafter = loaded.dspark
    ids = torch.tensor(PROMPTS[1])
    out = loaded(ids, [loaded.new_state()], [len(ids)], capture_layers=drafter.capture_layers)
    state = drafter.new_state()
    drafter.observe(state, ids, out.hidden, out.features)
    before = state.snapshot()
    first = drafter.propose([state], [7], dspark.SamplingParams(), [torch.Generator()])
    after = state.snapshot()
    assert before["length"] == after["length"] == len(ids)
    assert all(torch.equal(x, y) for x, y in zip(before["latents"], after["latents"]))
    second = drafter.propose([state], [7], dspark.SamplingParams(), [torch.Generator()])
    assert first.tokens.shape == (1, 5) and torch.equal(first.tokens, second.tokens)
    assert torch.isfinite(first.confidence).all()
