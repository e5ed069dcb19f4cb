"""Pretraining on the tiny V4 config: the loss falls, the run respects its budgets, and the saved
directory loads with `dspark.load_model` and generates text from text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dspark
from dspark.tiny.model_config import load_config
from dspark.tiny.packing import load_packed
from dspark.tiny.pretrain import METRICS_FILE, PretrainConfig, lr_at, pretrain, save_pretrained
from dspark.tiny.tokenizer import load_tokenizer

CONFIGS = Path(dspark.__file__).parent / "configs"


def _run(tiny_data, config_name: str = "tiny-v4.json", **overrides):
    settings = dict(steps=40, batch_size=4, lr=3e-3, warmup_steps=5, eval_every=20, eval_rows=8, progress=False)
    settings.update(overrides)
    tok = load_tokenizer(tiny_data["tokenizer"])
    data = load_packed(tiny_data["packed"], tiny_data["tokenizer"])
    return pretrain(load_config(CONFIGS / config_name), data, tok, PretrainConfig(**settings))


@pytest.fixture(scope="module")
def trained(tiny_data):
    return _run(tiny_data)


def test_loss_falls_on_train_and_heldout(trained):
    _, metrics = trained
    first, last = metrics["heldout"][0], metrics["heldout"][-1]
    assert first["step"] == 0 and last["step"] == metrics["steps"] == 40
    for domain in ("code", "prose"):
        assert last[domain] < first[domain] - 1.0, (domain, first, last)
    losses = [loss for _, loss in metrics["train_loss"]]
    assert losses[-1] < losses[0]
    assert metrics["stopped_by"] == "steps" and metrics["tokens"] == 40 * 4 * 32
    assert metrics["tokens_per_s"] > 0 and not any(p.requires_grad for p in trained[0].parameters())


def test_saved_checkpoint_loads_and_generates_text(trained, tiny_data, tmp_path):
    model, metrics = trained
    save_pretrained(model, tmp_path, tiny_data["tokenizer"], metrics, save_dtype="float32")
    assert json.loads((tmp_path / METRICS_FILE).read_text())["steps"] == 40
    loaded = dspark.load_model(tmp_path)
    assert loaded.tokenizer is not None and loaded.has_mtp is False
    ids = torch.tensor(loaded.tokenizer.encode("the king", add_special_tokens=False))
    with torch.no_grad():
        want = model(ids, [model.new_state()], [len(ids)]).logits
        got = loaded(ids, [loaded.new_state()], [len(ids)]).logits
    assert torch.equal(got, want)  # float32 save: the very weights that were trained
    out = dspark.generate(loaded, "the king", max_new_tokens=8)
    assert isinstance(out.text, str) and out.stats.new_tokens >= 1


def test_bfloat16_save_is_smaller_and_close(trained, tiny_data, tmp_path):
    model, metrics = trained
    save_pretrained(model, tmp_path / "bf16", tiny_data["tokenizer"], metrics, save_dtype="bfloat16")
    save_pretrained(model, tmp_path / "fp32", tiny_data["tokenizer"], metrics, save_dtype="float32")
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("bf16", "fp32")}
    assert size["bf16"] < 0.6 * size["fp32"]
    loaded = dspark.load_model(tmp_path / "bf16")
    ids = torch.tensor(loaded.tokenizer.encode("thou art", add_special_tokens=False))
    with torch.no_grad():
        want = model(ids, [model.new_state()], [len(ids)]).logits.log_softmax(-1)
        got = loaded(ids, [loaded.new_state()], [len(ids)]).logits.log_softmax(-1)
    assert (got.exp() - want.exp()).abs().sum(-1).max() < 0.1  # total variation of bf16 rounding


def test_batch_larger_than_the_data_fails_before_training(tiny_data):
    with pytest.raises(ValueError, match="batch_size: 100000"):
        _run(tiny_data, batch_size=100_000)


def test_time_budget_ends_the_run_with_the_schedule_done(tiny_data):
    _, metrics = _run(tiny_data, steps=100_000, max_minutes=0.04, reserve_s=0.0, eval_every=100_000)
    assert metrics["stopped_by"] == "time" and 0 < metrics["steps"] < 100_000
    assert metrics["train_s"] < 0.04 * 60 + 5


def test_deepseek_v41_engram_target_round_trips(tiny_data, tmp_path):
    model, metrics = _run(tiny_data, "tiny-v41.json", steps=3, eval_rows=2)
    assert metrics["model_options"]["prefill_mode"] == "exact"  # every row of a training call computed
    save_pretrained(model, tmp_path, tiny_data["tokenizer"], metrics, save_dtype="float32")
    loaded = dspark.load_model(tmp_path, **metrics["model_options"])
    assert torch.equal(loaded.engram_token_map, model.engram_token_map)  # tokenizer bound on both sides
    ids = torch.tensor(loaded.tokenizer.encode("sweet love", add_special_tokens=False))
    with torch.no_grad():
        assert torch.equal(loaded(ids, [loaded.new_state()], [len(ids)]).logits,
                           model(ids, [model.new_state()], [len(ids)]).logits)


def test_schedule_warms_up_then_decays_to_the_floor():
    c = PretrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(c, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(c, 9, 0.0) == pytest.approx(1e-3)
    assert lr_at(c, 50, 1.0) == pytest.approx(1e-4)
    decay = [lr_at(c, 20, p / 10) for p in range(11)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


@pytest.mark.parametrize("bad, match", [
    (dict(steps=0), "steps: 0"),
    (dict(batch_size=1.5), "batch_size: 1.5"),
    (dict(max_minutes=-1.0), "max_minutes: -1.0"),
    (dict(max_minutes=0.5, reserve_s=45.0), "reserve_s=45.0"),
    (dict(save_dtype="float16"), "save_dtype: 'float16'"),
    (dict(precision="fp16"), "precision: .fp16."),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(grad_clip=0.0), "grad_clip 0.0"),
])
def test_config_errors_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        PretrainConfig(**bad)
