"""Engine: continuous batching gives the same tokens as one request alone; nothing leaks."""

import json
import random
from importlib import resources

import pytest
import torch

import dspark
from dspark.engine import Engine, EngineConfig, EngineFull
from dspark.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _drain(engine, tokens, finished):
    for event in engine.step():
        tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
        if event.finished:
            finished[event.request_id] = event.finish_reason


@pytest.mark.parametrize("draft_tokens", [0, 3, "auto"])
def test_staggered_arrivals_equal_single_request_generate(tiny, draft_tokens):
    prompts = _prompts(9, seed=1)
    reference = [dspark.generate(tiny, p, max_new_tokens=12).token_ids for p in prompts]
    engine = Engine(tiny, EngineConfig(max_running=4, prefill_chunk=7, draft_tokens=draft_tokens, drafter="ngram"))
    tokens, finished, pending = {}, {}, list(enumerate(prompts))
    while pending or engine.has_work():
        for _ in range(min(2, len(pending))):  # two arrivals per step, while others are mid-flight
            i, p = pending.pop(0)
            engine.add_request(p, SamplingParams(), 12, request_id=f"r{i}")
        _drain(engine, tokens, finished)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert set(finished.values()) == {"length"}


def test_random_admit_abort_sequences_leave_nothing_behind(tiny):
    rng = random.Random(0)
    engine = Engine(tiny, EngineConfig(max_running=3, max_waiting=5, draft_tokens=2, drafter="ngram"))
    states, live = [], set()
    for step in range(60):
        for _ in range(rng.randint(0, 2)):
            try:
                rid = engine.add_request(_prompts(1, seed=step * 7 + len(live))[0], SamplingParams(temperature=1.0, seed=step),
                                         rng.randint(1, 10))
                live.add(rid)
            except EngineFull:
                assert len(engine.waiting) == 5
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            req = next((r for r in list(engine.waiting) + engine.running if r.request_id == victim), None)
            assert engine.abort(victim)
            assert req.state is None and req.dstate is None
            live.discard(victim)
        states += [r for r in engine.running]
        for event in engine.step():
            if event.finished:
                live.discard(event.request_id)
    while engine.has_work():
        for event in engine.step():
            if event.finished:
                live.discard(event.request_id)
    assert not live and not engine.waiting and not engine.running
    assert all(r.state is None and r.dstate is None for r in states)
    assert not engine.abort("never-existed")


def test_queue_limit_and_bad_requests_are_named(tiny):
    engine = Engine(tiny, EngineConfig(max_running=1, max_waiting=1, max_prompt_tokens=8, max_new_tokens=16))
    engine.add_request([1, 2], SamplingParams(), 4, request_id="a")
    with pytest.raises(EngineFull):
        engine.add_request([1, 2], SamplingParams(), 4)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request([1], SamplingParams(), 4, request_id="a")
    for args, needle in [(([],), "non-empty"), (([1, 999],), "999"), (([1] * 9,), "max_prompt_tokens"),
                         (([1], SamplingParams(), 0), "max_new_tokens"), (([1], SamplingParams(), 17), "max_new_tokens")]:
        with pytest.raises(ValueError, match=needle):
            engine.add_request(*args)


@pytest.mark.parametrize("bad", [dict(max_running=0), dict(prefill_chunk=-1), dict(planner="x"),
                                 dict(draft_tokens=-2), dict(draft_tokens="all")])
def test_engine_config_is_validated(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_trace_records_agree_with_stats(tiny):
    engine = Engine(tiny, EngineConfig(draft_tokens=4, drafter="ngram", trace=True))
    motif = [5, 6, 7, 8]
    rid = engine.add_request(motif * 4, SamplingParams(), 20)
    stats = None
    while engine.has_work():
        for event in engine.step():
            stats = event.stats
    trace = engine.take_trace()
    assert len(trace) == stats.rounds and all(t["request_id"] == rid for t in trace)
    assert sum(t["accepted"] for t in trace) == stats.verified_tokens - stats.rejected_tokens
    assert sum(t["committed"] for t in trace) == stats.new_tokens - 1
    assert all(len(t["draft"]) == 5 and len(t["confidence"]) == 5 for t in trace)
    assert engine.take_trace() == []
