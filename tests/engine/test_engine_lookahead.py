"""`EngineConfig(overlap=True)`: plain greedy rounds keep one static step in flight (`Lookahead`).

Tokens and traces equal the synchronous engine's (static and dynamic paths) under staggered arrivals,
finishes, slot moves and buckets; in steady state most steps come from the step in flight; a step in
flight that the batch outgrew is dropped without a trace; sampled requests and drafters take the usual
round; aborts free every slot; bad settings are refused by name. On the CPU the steps run eagerly and
in order: the logic is the one the GPU runs, the overlap itself is not measured here."""

import json
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

import dspark
from dspark.engine import Engine, EngineConfig
from dspark.engine.lookahead import Lookahead
from dspark.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the static-engine helpers
from test_engine_static import LIMITS, _prompts, _staggered  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


def count_launches(monkeypatch, cls=Lookahead):
    """Count the steps (rounds, for `DraftLookahead`) of `cls` launched from host values (the one in
    flight was not usable) and all of them."""
    counts = {"host": 0, "all": 0}
    from_host, launch = cls._launch_from_host, cls._launch

    def counting_host(self, *args):
        counts["host"] += 1
        return from_host(self, *args)

    def counting_all(self, *args):
        counts["all"] += 1
        return launch(self, *args)

    monkeypatch.setattr(cls, "_launch_from_host", counting_host)
    monkeypatch.setattr(cls, "_launch", counting_all)
    return counts


def test_overlap_gives_the_synchronous_engines_tokens_and_traces(tiny, monkeypatch):
    prompts = _prompts(7, seed=3)
    greedy = lambda i: SamplingParams()  # noqa: E731
    dynamic, dynamic_trace = _staggered(tiny, prompts, greedy, 16, static_decode=False)
    static, static_trace = _staggered(tiny, prompts, greedy, 16, static_decode=True, overlap=False)
    counts = count_launches(monkeypatch)
    ahead, ahead_trace = _staggered(tiny, prompts, greedy, 16, static_decode=True, overlap=True)
    assert ahead == static == dynamic
    assert ahead_trace == static_trace
    assert 0 < counts["host"] < counts["all"] - counts["host"]  # most steps were already in flight


def test_steady_batch_reads_every_step_from_the_step_in_flight(tiny, monkeypatch):
    """Three requests decoding together to the end: one host launch, then every round's tokens come
    from the step launched during the round before (plus the last, dropped, speculative step)."""
    counts = count_launches(monkeypatch)
    engine = Engine(tiny, EngineConfig(max_running=3, static_decode=True, overlap=True, **LIMITS))
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    rids = [engine.add_request(p, SamplingParams(), 12) for p in prompts]
    tokens = {rid: [] for rid in rids}
    rounds = 0
    while engine.has_work():
        events = engine.step()
        rounds += any(not r.in_prefill for r in engine.running) or bool(events)
        for event in events:
            tokens[event.request_id] += event.new_token_ids
    reference = dspark.generate(tiny, prompts, max_new_tokens=12)
    assert [tokens[rid] for rid in rids] == [out.token_ids for out in reference]
    finished_early = any(len(t) < 12 for t in tokens.values())
    assert counts["host"] <= 1 + 2 * finished_early  # a finish changes the batch: the next step restarts
    assert counts["all"] >= 11
    assert engine.slots.free == engine.slots.slots and engine.lookahead.pending is None


def test_sampled_requests_and_drafters_take_the_usual_round(tiny, monkeypatch):
    counts = count_launches(monkeypatch)
    prompts = _prompts(4, seed=5)
    params = lambda i: SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams()  # noqa: E731
    mixed, _ = _staggered(tiny, prompts, params, 10, static_decode=True, overlap=True)
    reference, _ = _staggered(tiny, prompts, params, 10, static_decode=True, overlap=False)
    assert mixed == reference  # seeded sampling on the static path: the same draws either way
    drafted = Engine(tiny, EngineConfig(max_running=2, static_decode=True, overlap=True, draft_tokens=3,
                                        drafter="ngram", **LIMITS))
    assert drafted.lookahead is None
    assert counts["all"] > 0  # the greedy-only rounds of the mixed run did go ahead


def test_abort_with_a_step_in_flight_frees_its_slot(tiny):
    engine = Engine(tiny, EngineConfig(max_running=3, static_decode=True, overlap=True, **LIMITS))
    rids = [engine.add_request(p, SamplingParams(), 20) for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
    for _ in range(4):
        engine.step()
    assert engine.lookahead.pending is not None
    assert engine.abort(rids[1]) and engine.lookahead.pending is None
    tokens = {rid: [] for rid in rids}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
    assert engine.slots.free == engine.slots.slots and not engine.slots.holder_slots()
    alone = Engine(tiny, EngineConfig(max_running=3, static_decode=False, **LIMITS))
    alone.add_request([6, 7, 8, 9], SamplingParams(), 20)
    expected = []
    while alone.has_work():
        for event in alone.step():
            expected += event.new_token_ids
    assert len(expected) == 20 and tokens[rids[2]] and expected[-len(tokens[rids[2]]):] == tokens[rids[2]]


def test_overlap_settings_are_validated(tiny):
    with pytest.raises(ValueError, match="overlap must be None \\(auto\\) or a bool, got 1"):
        EngineConfig(overlap=1)
    with pytest.raises(ValueError, match="overlap=True needs the static path \\(static_decode=True or None\\)"):
        EngineConfig(static_decode=False, overlap=True)
    with pytest.raises(ValueError, match="overlap=True needs the static path, which this engine does not run"):
        Engine(tiny, EngineConfig(overlap=True, **LIMITS))  # CPU: static_decode=None picks the dynamic path
    # None (default): on wherever the static path runs, off where it does not (here: the CPU's dynamic path)
    assert EngineConfig().overlap is None and Engine(tiny, EngineConfig(**LIMITS)).lookahead is None
    assert Engine(tiny, EngineConfig(static_decode=True, **LIMITS)).lookahead is not None
    assert Engine(tiny, EngineConfig(static_decode=True, overlap=False, **LIMITS)).lookahead is None
    assert Engine(tiny, EngineConfig(static_decode=True, draft_tokens=3, drafter="ngram", **LIMITS)).lookahead is None
    assert torch.device(tiny.device).type == "cpu"
