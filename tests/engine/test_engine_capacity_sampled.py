""""auto" plans a round with a sampled request by the table of sampled rounds (`capacity_sampled`):
on the static path such a round is another kind of round (synchronous, the sampled propose and
acceptance), priced by `dspark profile --engine --temperature`; all-greedy rounds keep `capacity`."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.engine import Engine, EngineConfig
from dspark.request import Request
from dspark.round import RoundConfig
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable

from test_engine_auto_plain import TABLE, LowConfidenceDrafter

# Drafting costs nothing: a round of any budget runs at a plain step's rate, so with survival 0.1 every
# extra draft adds expected tokens and the largest budget wins.
FREE = CapacityTable((1, 2, 4, 8), (50.0,) * 4, "hand-made: drafting is free", "",
                     plain_requests=(1, 8), plain_steps_per_second=(50.0, 50.0))


@pytest.fixture(scope="module")
def model():
    return dspark.init_model(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()))


def _verified(model, temperatures, capacity_sampled, max_new=24) -> dict[str, str]:
    """Each request's verified draft counts, one digit per round."""
    engine = Engine(model, EngineConfig(max_running=len(temperatures), draft_tokens="auto",
                                        drafter=LowConfidenceDrafter(), capacity=TABLE,
                                        capacity_sampled=capacity_sampled, trace=True))
    for i, t in enumerate(temperatures):
        engine.add_request(list(range(3, 19)), SamplingParams(t, seed=i), max_new, request_id=f"r{i}")
    while engine.has_work():
        engine.step()
    out: dict[str, str] = {}
    for rec in engine.take_trace():
        out[rec["request_id"]] = out.get(rec["request_id"], "") + str(rec["verified"])
    return out


def test_a_sampled_request_is_planned_by_the_sampled_table(model):
    # FREE: every round drafts γ (the caps cut the last ones); TABLE: two rounds of n = 1, then plain
    assert _verified(model, [1.0], FREE)["r0"].startswith("3" * 20)
    assert _verified(model, [1.0], None)["r0"].startswith("11" + "0000" + "1" + "0" * 8)


def test_greedy_rounds_keep_the_greedy_table_and_a_mixed_round_takes_the_sampled_one(model):
    assert _verified(model, [0.0], FREE)["r0"].startswith("11" + "0000" + "1" + "0" * 8)
    mixed = _verified(model, [0.0, 1.0], FREE)
    assert mixed["r0"].startswith("3" * 20) and mixed["r1"].startswith("3" * 20)


def test_round_config_table():
    greedy = Request([1], None, torch.Generator(), 4, frozenset())
    sampled = Request([1], None, torch.Generator(), 4, frozenset(), SamplingParams(0.7, seed=0))
    cfg = RoundConfig("auto", "async", TABLE, None, FREE)
    assert cfg.table([greedy]) is TABLE and cfg.table([greedy, sampled]) is FREE
    assert RoundConfig("auto", "async", TABLE).table([sampled]) is TABLE


def test_the_engine_defaults_to_the_drafters_sampled_table(model):
    drafter = LowConfidenceDrafter()
    drafter.capacity_tables = {"cpu": TABLE, "cpu-sampled": FREE}
    cfg = Engine(model, EngineConfig(draft_tokens="auto", drafter=drafter)).round_config
    assert cfg.capacity is TABLE and cfg.capacity_sampled is FREE
    cfg = Engine(model, EngineConfig(draft_tokens="auto", drafter=drafter, capacity=TABLE)).round_config
    assert cfg.capacity_sampled is TABLE  # a table given is the table for both kinds of round
    drafter.capacity_tables = {"cpu": TABLE}
    assert Engine(model, EngineConfig(draft_tokens="auto", drafter=drafter)).round_config.capacity_sampled is TABLE


@pytest.mark.parametrize("name", ["capacity", "capacity_sampled"])
def test_a_table_that_is_not_one_is_refused(name):
    with pytest.raises(ValueError, match=f"{name} must be None or a CapacityTable, got str"):
        EngineConfig(**{name: "h200.json"})


def test_a_table_from_another_gpu_is_named(monkeypatch):
    """A CUDA table measured on another card prices this one wrong: `foreign_table` names both cards; a
    CPU device, or the card itself, gives nothing."""
    from dspark.engine import engine as engine_module

    h200 = CapacityTable((2, 4), (50.0, 40.0), "NVIDIA H200, engine rounds", "", conditions={"device": "NVIDIA H200"})
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert "measured on NVIDIA H200, not this NVIDIA H100 80GB HBM3" in engine_module.foreign_table(
        h200, torch.device("cuda"))
    assert engine_module.foreign_table(h200, torch.device("cpu")) is None
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA H200")
    assert engine_module.foreign_table(h200, torch.device("cuda")) is None


def test_the_default_table_is_the_one_measured_on_this_card(monkeypatch):
    """A drafter may ship a table per GPU: on a card one of them was measured on, that one (greedy and
    sampled apart); on another card, or with none measured there, the device type's own "cuda" table."""
    from dspark.engine import engine as engine_module

    def table(card, label):
        return CapacityTable((2, 4), (50.0, 40.0), f"{card}, {label}", "", conditions={"device": card})

    h200, h200_s = table("NVIDIA H200", "greedy"), table("NVIDIA H200", "sampled")
    h100, h100_s = table("NVIDIA H100 80GB HBM3", "greedy"), table("NVIDIA H100 80GB HBM3", "sampled")
    drafter = LowConfidenceDrafter()
    drafter.capacity_tables = {"cpu": TABLE, "cuda": h200, "cuda-sampled": h200_s, "cuda-h100": h100,
                               "cuda-h100-sampled": h100_s}
    pick = engine_module.default_capacity
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert pick(drafter, "cuda") is h100 and pick(drafter, "cuda", sampled=True) is h100_s
    assert pick(drafter, "cpu") is TABLE and pick(drafter, "cpu", sampled=True) is TABLE
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA H200")
    assert pick(drafter, "cuda") is h200 and pick(drafter, "cuda", sampled=True) is h200_s
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA B200")
    assert pick(drafter, "cuda") is h200 and pick(drafter, "cuda", sampled=True) is h200_s
    del drafter.capacity_tables["cuda-h100-sampled"]  # no sampled table of this card: the type's sampled one
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert pick(drafter, "cuda") is h100 and pick(drafter, "cuda", sampled=True) is h200_s
    drafter.capacity_tables = {"cpu": TABLE, "cuda-h100": h100}  # a card's table alone, no "cuda" one
    assert pick(drafter, "cuda") is h100 and pick(drafter, "cuda", sampled=True) is h100
    monkeypatch.setattr(engine_module, "device_name", lambda device: "NVIDIA H200")
    assert pick(drafter, "cuda").label.startswith("cpu-default")  # not this card's: the synthetic table


def test_an_auto_engine_warns_of_a_foreign_default_table_only(model, monkeypatch):
    """The engine checks the default tables "auto" will plan by (one warning per distinct message), not
    a table it was given, nor any table an engine at a fixed budget never reads."""
    import warnings

    from dspark.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "foreign_table", lambda table, device: f"foreign: {table.label}")
    drafter = LowConfidenceDrafter()
    drafter.capacity_tables = {"cpu": TABLE, "cpu-sampled": FREE}
    with pytest.warns(UserWarning) as caught:
        Engine(model, EngineConfig(draft_tokens="auto", drafter=drafter))
    assert sorted(str(w.message) for w in caught) == sorted([f"foreign: {FREE.label}", f"foreign: {TABLE.label}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(model, EngineConfig(draft_tokens="auto", drafter=drafter, capacity=TABLE))
        Engine(model, EngineConfig(draft_tokens=2, drafter=drafter))
