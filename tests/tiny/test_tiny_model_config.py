"""Fitting configs to the tokenizer, training options per family, the shipped dspark-tiny config,
and the routing-bias balancer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dspark
from dspark.tiny.balance import ExpertBalancer, score_gates
from dspark.tiny.model_config import DSPARK_TINY, fit_config, load_config, text_section, training_options
from dspark.tiny.tokenizer import load_tokenizer

CONFIGS = Path(dspark.__file__).parent / "configs"


def test_fit_config_flat_v4(tiny_data):
    tok = load_tokenizer(tiny_data["tokenizer"])
    base = load_config(CONFIGS / "tiny-v4.json")
    fitted = fit_config(base, tok)
    assert fitted["vocab_size"] == tok.get_vocab_size() != base["vocab_size"]
    assert (fitted["bos_token_id"], fitted["eos_token_id"], fitted["pad_token_id"]) == (0, 1, 2)
    assert base["vocab_size"] == 258  # the input is not modified
    assert dspark.init_model(fitted).embed.weight.shape[0] == tok.get_vocab_size()


def test_fit_config_composite_v41_sets_engram_and_noise(tiny_data):
    from dspark.models.deepseek_v41.engram_hash import build_token_map

    tok = load_tokenizer(tiny_data["tokenizer"])
    fitted = fit_config(load_config(CONFIGS / "tiny-v41.json"), tok)
    text = text_section(fitted)
    assert text["vocab_size"] == tok.get_vocab_size()
    assert text["engram_compressed_vocab_size"] == build_token_map(tok)[1] < tok.get_vocab_size()
    assert text["engram_pad_token_id"] == 2 and text["dspark_noise_token_id"] == 3
    model = dspark.init_model(fitted)
    model.bind_tokenizer(tok)  # raises if the compressed vocabulary did not match


def test_training_options_follow_the_family():
    assert training_options({"model_type": "deepseek_v4"}) == {}
    if "deepseek_v41" in dspark.api.MODEL_FAMILIES:
        accepted = dspark.api.MODEL_FAMILIES["deepseek_v41"].options
        wanted = {"prefill_mode": "exact", "cache_qat": True}
        assert training_options({"model_type": "deepseek_v41"}, cache_qat=True) == {
            k: v for k, v in wanted.items() if k in accepted}
        assert "prefill_mode" in accepted
    with pytest.raises(ValueError, match="'llama'"):
        training_options({"model_type": "llama"})


def test_shipped_dspark_tiny_config_is_v41_and_in_budget():
    config = load_config(DSPARK_TINY)
    text = text_section(config)
    assert config["model_type"] == "deepseek_v41" and text["vocab_size"] == 8192
    model = dspark.init_model(config, dtype=torch.bfloat16)
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert n_bytes < 32e6  # the target's share of the 40 MB target + drafter budget
    with pytest.raises(FileNotFoundError, match="no-such"):
        load_config("no-such-config")


def test_balancer_pushes_biases_against_the_load():
    model = dspark.init_model(load_config(CONFIGS / "tiny-v4.json"), seed=1)
    balancer = ExpertBalancer(model, rate=0.01)
    gates = score_gates(model)
    assert gates and all(float(g.bias.abs().sum()) == 0 and not g.bias.requires_grad for g in gates.values())
    ids = torch.randint(0, 256, (40,))
    model(ids, [model.new_state()], [40])  # outside observe(): not counted
    assert balancer.update() is None
    with balancer.observe():
        model(ids, [model.new_state()], [40])
    loads = {name: load.clone() for name, load in balancer.counts.items()}
    assert sorted(loads) == [name for name in gates if not name.startswith("mtp.")]  # the MTP block never ran
    imbalance = balancer.update()
    assert float(imbalance) >= 1.0
    for name, gate in gates.items():
        load = loads.get(name, torch.zeros_like(gate.bias))
        assert torch.equal(gate.bias, torch.sign(load.mean() - load) * 0.01 if name in loads else load)
    with pytest.raises(ValueError, match="-1"):
        ExpertBalancer(model, rate=-1)
