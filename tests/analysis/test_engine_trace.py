"""The engine's trace records follow docs/traces.md and agree with what the engine committed."""

import json
from importlib import resources

import pytest

import dspark
from dspark.analysis import number_steps, step_table, to_arrays, validate_record
from dspark.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


def test_records_chain_into_the_output(tiny):
    engine = Engine(tiny, EngineConfig(max_running=3, draft_tokens=3, drafter="ngram", trace=True))
    prompts = {"a": [5, 6, 7, 5, 6, 7, 5, 6], "b": [1, 2, 3, 4], "c": [9] * 6}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(temperature=0.0 if rid != "c" else 1.0, seed=3), 14,
                           request_id=rid, domain=f"set-{rid}")
    outputs = {rid: [] for rid in prompts}
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id] += event.new_token_ids
    trace = engine.take_trace()
    for i, r in enumerate(trace):
        validate_record(r, f"record {i}")
    for rid, out in outputs.items():
        mine = [r for r in trace if r["request_id"] == rid]
        assert [r["round"] for r in mine] == list(range(len(mine)))
        assert all(r["domain"] == f"set-{rid}" for r in mine)
        assert mine[0]["position"] == 1                         # token 0 comes from prefill
        assert all(b["position"] == a["position"] + a["committed"] for a, b in zip(mine, mine[1:]))
        assert [t for r in mine for t in r["tokens"]] == out[1:]
        assert all(len(r["draft"]) == 5 and r["verified"] <= 3 and r["confidence_logits"] is None for r in mine)
    assert {r["temperature"] for r in trace} == {0.0, 1.0}
    steps = step_table(number_steps(trace))
    assert steps["load"].max() == 3 and steps["committed"].sum() == to_arrays(trace).committed.sum()


def test_domain_must_be_a_string(tiny):
    engine = Engine(tiny, EngineConfig(trace=True))
    with pytest.raises(ValueError, match="domain must be a str, got 3"):
        engine.add_request([1, 2], domain=3)
