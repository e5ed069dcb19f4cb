"""Checkpoint names, the drafter directory round trip, DSpark checkpoints in `load_model`, and
`resolve_drafter`."""

import json

import pytest
import torch

import dspark
from draft_targets import tiny_v4_config
from dspark.draft import DSparkConfig, DSparkDrafter, MtpDrafter, NgramDrafter, resolve_drafter, save_drafter
from dspark.draft.io import add_to_checkpoint
from dspark.models.deepseek_v4.checkpoint import save_checkpoint
from dspark.verify.sts import StsCalibration


@pytest.fixture(scope="module")
def drafter(tiny):
    return DSparkDrafter(tiny, DSparkConfig.for_target(tiny.config, dspark_markov_rank=16)).init_weights(5)


def _same_weights(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _greedy_tokens(drafter, target, prompt):
    ids = torch.tensor(prompt)
    out = target(ids, [target.new_state()], [len(prompt)], capture_layers=drafter.capture_layers)
    state = drafter.new_state()
    drafter.observe(state, ids, out.hidden, out.features)
    return drafter.propose([state], [1], dspark.SamplingParams(), [torch.Generator()]).tokens


def test_parameter_names_are_the_shipped_checkpoint_keys(drafter):
    keys = set(drafter.model.state_dict())
    expected = {
        "mtp.0.main_proj.weight": (64, 3 * 64), "mtp.0.main_norm.weight": (64,),
        "mtp.2.norm.weight": (64,), "mtp.2.hc_head_fn": (4, 4 * 64), "mtp.2.hc_head_base": (4,),
        "mtp.2.hc_head_scale": (1,), "mtp.2.markov_head.embed.weight": (258, 16),
        "mtp.2.markov_head.head.weight": (258, 16), "mtp.2.confidence_head.proj.weight": (1, 64 + 16),
    }
    for name, shape in expected.items():
        assert tuple(drafter.model.state_dict()[name].shape) == shape, name
    for i in range(3):  # every stage is a V4 layer under the target's names
        for leaf in ("attn.wq_a.weight", "attn.wkv.weight", "attn.wo_b.weight", "attn.attn_sink", "attn_norm.weight",
                     "ffn_norm.weight", "hc_attn_fn", "hc_ffn_scale", "ffn.gate.weight", "ffn.gate.bias",
                     "ffn.experts.7.w2.weight", "ffn.shared_experts.w1.weight"):
            assert f"mtp.{i}.{leaf}" in keys
    assert all(key.startswith("mtp.") for key in keys)
    assert not any(k.startswith(("mtp.1.main", "mtp.0.norm", "mtp.1.markov", "mtp.0.hc_head")) for k in keys)
    head_fp32 = ("markov_head", "confidence_head", "norm.weight", "hc_")
    state = drafter.model.state_dict()
    assert all(t.dtype == torch.float32 for k, t in state.items() if any(h in k for h in head_fp32))


def test_drafter_directory_round_trip(tiny, drafter, tmp_path):
    drafter.set_calibration(StsCalibration((0.9, 1.1, 1.3, 1.5, 1.7)))
    greedy_cal = StsCalibration((1.0,) * 5, "affine", biases=(0.5, 0.4, 0.3, 0.2, 0.1), sampling_temperature=0.0)
    drafter.set_calibration(greedy_cal, greedy=True)
    try:
        save_drafter(drafter, tmp_path / "d")
    finally:
        drafter.set_calibration(None)
        drafter.set_calibration(None, greedy=True)
    assert {p.name for p in (tmp_path / "d").iterdir()} == {"config.json", "model.safetensors", "sts.json",
                                                            "sts-greedy.json"}
    stored = json.loads((tmp_path / "d" / "config.json").read_text())
    assert stored["dspark_markov_rank"] == 16 and stored["target"]["vocab_size"] == 258
    loaded = dspark.load_drafter(tmp_path / "d", tiny)
    assert loaded.config == drafter.config and _same_weights(loaded, drafter)
    assert loaded.calibration.temperatures == (0.9, 1.1, 1.3, 1.5, 1.7)
    assert loaded.greedy_calibration == greedy_cal and loaded.calibration_for(True) is loaded.greedy_calibration
    assert torch.equal(_greedy_tokens(loaded, tiny, [5, 6, 7, 8]), _greedy_tokens(drafter, tiny, [5, 6, 7, 8]))


def test_capacity_tables_travel_with_the_drafter_and_are_the_engines_default_there(tiny, drafter, tmp_path):
    from dspark.engine.engine import default_capacity
    from dspark.verify.capacity import CapacityTable

    table = CapacityTable((1, 4), (40.0, 30.0), "cpu test table", plain_requests=(1,), plain_steps_per_second=(60.0,))
    drafter.capacity_tables = {"cpu": table}
    try:
        save_drafter(drafter, tmp_path / "d")
    finally:
        drafter.capacity_tables = {}
    assert (tmp_path / "d" / "capacity-cpu.json").is_file()
    loaded = dspark.load_drafter(tmp_path / "d", tiny)
    assert loaded.capacity_tables == {"cpu": table}
    assert default_capacity(loaded, "cpu") == table
    assert default_capacity(loaded, torch.device("cuda", 0)).label.startswith("cpu-default")  # none for CUDA
    assert default_capacity(None, "cpu").label.startswith("cpu-default")


def test_loading_for_another_target_names_the_field(drafter, tmp_path):
    save_drafter(drafter, tmp_path / "d")
    other = dspark.init_model(tiny_v4_config(hidden_size=32), seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        dspark.load_drafter(tmp_path / "d", other)
    with pytest.raises(FileNotFoundError):
        dspark.load_drafter(tmp_path / "missing", other)


@pytest.mark.parametrize("quantize", [False, True])
def test_load_model_attaches_the_drafter_of_a_dspark_checkpoint(drafter, tmp_path, quantize):
    target = dspark.init_model(tiny_v4_config(), seed=0)
    target.has_mtp = False  # a DSpark checkpoint keeps its stages, not an MTP block, under mtp.*
    save_checkpoint(target, tmp_path, quantize=False)
    add_to_checkpoint(drafter, tmp_path, quantize=quantize)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dspark_block_size"] == 5 and config["dspark_target_layer_ids"] == [3, 4, 5]
    model = dspark.load_model(tmp_path)
    assert isinstance(model.dspark, DSparkDrafter) and not model.has_mtp
    assert model.dspark.config == drafter.config and model.dspark.target is model
    if not quantize:
        assert _same_weights(model.dspark, drafter)
    else:  # stage linears stored FP8 / FP4 as released: close, not equal
        a, b = model.dspark.model.state_dict(), drafter.model.state_dict()
        assert torch.equal(a["mtp.2.markov_head.head.weight"], b["mtp.2.markov_head.head.weight"].bfloat16().float())
        torch.testing.assert_close(a["mtp.0.main_proj.weight"], b["mtp.0.main_proj.weight"], atol=0.1, rtol=0.2)
    assert resolve_drafter(model, None) is model.dspark
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = dspark.generate(model, prompt, max_new_tokens=10).token_ids
    assert dspark.generate(model, prompt, max_new_tokens=10, draft_tokens="auto").token_ids == plain


def test_plain_checkpoint_has_no_dspark_drafter(tmp_path):
    model = dspark.init_model(tiny_v4_config(), seed=1)
    save_checkpoint(model, tmp_path, quantize=False)
    loaded = dspark.load_model(tmp_path)
    assert loaded.dspark is None and loaded.has_mtp
    assert isinstance(resolve_drafter(loaded, None), MtpDrafter)


def test_resolve_drafter_names_and_defaults(tiny, drafter):
    assert isinstance(resolve_drafter(tiny, "ngram"), NgramDrafter)
    assert isinstance(resolve_drafter(tiny, "mtp"), MtpDrafter)
    assert isinstance(resolve_drafter(tiny, None), MtpDrafter)  # random MTP block, no DSpark stages
    with pytest.raises(ValueError, match="'dspark' is not available"):
        resolve_drafter(tiny, "dspark")
    assert resolve_drafter(tiny, drafter) is drafter
    bare = dspark.init_model(tiny_v4_config(num_nextn_predict_layers=0))
    assert isinstance(resolve_drafter(bare, None), NgramDrafter)
    with pytest.raises(ValueError, match="'mtp' is not available"):
        resolve_drafter(bare, "mtp")
