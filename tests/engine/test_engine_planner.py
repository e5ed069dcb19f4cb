"""The engine's verify lengths under draft_tokens="auto" are Algorithm 1's (spec §4.2) for the
confidences and capacity of that very step, with every request of the step planned together.
tests/verify/test_planner.py covers the planner on hand-made inputs; this checks the engine feeds
it the right batch."""

import json
from importlib import resources

import dspark
from dspark.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from dspark.verify.planner import plan_algorithm1

# A step costs 10 ms up to 6 batch tokens, then 10 ms more per token: some drafts pay, most do not.
CLIFF = CapacityTable((1, 6, 7, 64), (100.0, 100.0, 50.0, 100.0 / 59), "hand-made cliff")


def _calls(trace):
    """Split the trace into verify calls: consecutive records of one call share its `load`."""
    calls, i = [], 0
    while i < len(trace):
        calls.append(trace[i:i + trace[i]["load"]])
        i += trace[i]["load"]
    return calls


def test_engine_verify_lengths_are_algorithm1_of_the_step():
    model = dspark.init_model(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()))
    engine = Engine(model, EngineConfig(max_running=3, draft_tokens="auto", drafter="ngram", capacity=CLIFF,
                                        trace=True))
    motif = [5, 6, 7, 8]
    for i, prompt in enumerate([motif * 4, [9, 3] * 5, list(range(20, 31))]):
        engine.add_request(prompt, SamplingParams(), 16, request_id=f"r{i}")
    while engine.has_work():
        engine.step()
    calls = _calls(engine.take_trace())
    gamma = len(calls[0][0]["confidence"])
    assert any(len(c) == 3 for c in calls)
    decided = set()
    for call in calls:
        caps = [min(gamma, 16 - rec["position"] - 1) for rec in call]
        plan = plan_algorithm1([rec["confidence"] for rec in call], CLIFF, caps)
        assert list(plan.draft_lens) == [rec["verified"] for rec in call]
        decided.add(plan.draft_lens)
    assert len({sum(d) for d in decided}) > 1  # the cliff makes the planner choose, not just verify all
