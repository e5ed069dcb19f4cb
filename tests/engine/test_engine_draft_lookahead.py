"""`EngineConfig(overlap=True)` with a static DSpark drafter and a fixed budget: greedy drafting rounds
keep one round in flight (`DraftLookahead`).

Tokens, statistics and traces equal the synchronous engine's: with the shipped trained pair (real
acceptance, so rounds commit different lengths and the round in flight starts where round k's device
acceptance put it), and with a random pair under staggered arrivals, finishes, slot moves and buckets.
Most rounds come from the round in flight; a request near its budget cap runs the usual round; sampled
requests and the synchronous "auto" planner (Algorithm 1) take the usual round; aborts free every slot.
On the CPU the rounds run eagerly and in order: the logic is the one the GPU runs, the overlap itself is
not measured here. "auto" with planner "async": tests/engine/test_engine_draft_lookahead_auto.py."""

import sys
from pathlib import Path

import pytest

import dspark
from dspark.engine import Engine, EngineConfig
from dspark.engine.draft_lookahead import DraftLookahead
from dspark.engine.static_draft import StaticDraftRunner
from dspark.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the static-engine helpers
from test_engine_lookahead import count_launches  # noqa: E402
from test_engine_static import _drafters, _prompts, _staggered  # noqa: E402

TEXTS = ["def read_config(path):\n    ", "ROMEO.\nBut soft, what light through yonder",
         "class Cache:\n    def __init__(self, size):\n", "KING.\nNow, my good lords,"]


@pytest.fixture(scope="module")
def pair():
    return dspark.load_model("tiny")


@pytest.fixture(scope="module")
def tiny_v4():
    return dspark.init_model("tiny-v4", seed=0)


def _count_launches(monkeypatch):
    return count_launches(monkeypatch, DraftLookahead)


def _run(model, prompts, new, **config):
    engine = Engine(model, EngineConfig(max_running=4, static_decode=True, trace=True, max_prompt_tokens=64,
                                        max_new_tokens=64, **config))
    rids = [engine.add_request(p, SamplingParams(), new) for p in prompts]
    tokens, stats = {rid: [] for rid in rids}, {}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
            if event.finished:
                stats[event.request_id] = (event.stats.rounds, event.stats.verified_tokens, event.stats.new_tokens)
    assert engine.slots.free == engine.slots.slots
    return [tokens[rid] for rid in rids], engine.take_trace(), [stats[rid] for rid in rids], engine


def test_trained_pair_gives_the_synchronous_rounds(pair, monkeypatch):
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    draft = dict(draft_tokens=3, drafter=pair.dspark)
    sync, sync_trace, sync_stats, engine = _run(pair, prompts, 40, overlap=False, **draft)
    assert engine.draft_ahead is None
    counts = _count_launches(monkeypatch)
    ahead, ahead_trace, ahead_stats, engine = _run(pair, prompts, 40, overlap=True, **draft)
    assert ahead == sync and ahead_trace == sync_trace and ahead_stats == sync_stats
    assert ahead == [o.token_ids for o in dspark.generate(pair, TEXTS, max_new_tokens=40)]  # plain greedy
    accepted = [r["accepted"] for r in ahead_trace]
    assert len(set(accepted)) > 2  # rounds committed different lengths: the chaining was exercised
    # Most rounds came from the round in flight; the last rounds of each request (a cap in reach) ran
    # the usual way, and the batch changes when a request finishes.
    assert 0 < counts["host"] < counts["all"] - counts["host"]
    assert engine.draft_ahead.pending is None


def test_random_pair_under_staggered_arrivals(tiny_v4):
    dspark3 = _drafters(tiny_v4)["dspark3"]
    prompts = _prompts(6, seed=7)
    greedy = lambda i: SamplingParams()  # noqa: E731
    sync, sync_trace = _staggered(tiny_v4, prompts, greedy, 14, static_decode=True, overlap=False, **dspark3)
    ahead, ahead_trace = _staggered(tiny_v4, prompts, greedy, 14, static_decode=True, overlap=True, **dspark3)
    assert ahead == sync and ahead_trace == sync_trace


def test_sampled_requests_and_the_auto_planner_take_the_usual_round(pair, monkeypatch):
    counts = _count_launches(monkeypatch)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:2]]
    engine = Engine(pair, EngineConfig(max_running=2, static_decode=True, overlap=True, draft_tokens=3,
                                       drafter=pair.dspark, max_prompt_tokens=64, max_new_tokens=64))
    engine.add_request(prompts[0], SamplingParams(temperature=1.0, seed=1), 12)
    engine.add_request(prompts[1], SamplingParams(), 12)
    while engine.has_work():
        engine.step()
    assert counts["all"] == 0
    # Algorithm 1 plans on the round's own confidences: with overlap on by default its rounds run as usual
    # (planner "async" keeps them in flight: tests/engine/test_engine_draft_lookahead_auto.py).
    auto = Engine(pair, EngineConfig(max_running=2, static_decode=True, draft_tokens="auto", planner="sync",
                                     drafter=pair.dspark, max_prompt_tokens=64, max_new_tokens=64))
    assert auto.draft_ahead is None


def test_abort_with_a_round_in_flight_frees_its_slot(pair):
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    engine = Engine(pair, EngineConfig(max_running=3, static_decode=True, overlap=True, draft_tokens=3,
                                       drafter=pair.dspark, max_prompt_tokens=64, max_new_tokens=64))
    rids = [engine.add_request(p, SamplingParams(), 40) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.draft_ahead.pending is not None
    assert engine.abort(rids[1]) and engine.draft_ahead.pending is None
    tokens = {rid: [] for rid in rids}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
    assert engine.slots.free == engine.slots.slots and not engine.slots.holder_slots()
    expected = dspark.generate(pair, TEXTS[2], max_new_tokens=40).token_ids
    assert tokens[rids[2]] and expected[-len(tokens[rids[2]]):] == tokens[rids[2]]


def test_budget_is_validated(pair):
    engine = Engine(pair, EngineConfig(max_running=2, static_decode=True, overlap=True, draft_tokens=3,
                                       drafter=pair.dspark, max_prompt_tokens=64, max_new_tokens=64))
    with pytest.raises(ValueError, match="budget must be an int in \\[1, γ=5\\] or 'auto', got 0"):
        DraftLookahead(engine.runner, engine.static_draft, 0)
    with pytest.raises(ValueError, match="budget 5 needs 6 rows per step; the static step takes 4"):
        DraftLookahead(engine.runner, engine.static_draft, 5)
    assert engine.static_draft.static.n_draft == 3  # the engine's drafter drafts what it verifies
    narrow = StaticDraftRunner(pair.dspark, slots=2, tokens=4, n_draft=2)
    with pytest.raises(ValueError, match="budget 3 verifies up to 3 drafts; the static drafter drafts n_draft=2"):
        DraftLookahead(engine.runner, narrow, 3)


@pytest.mark.gpu
def test_trained_pair_on_cuda_graphs(monkeypatch):
    """On CUDA the rounds are graph replays and round k + 1 is queued before round k's results are
    read behind an event: the same tokens and traces as the synchronous rounds, most from the round
    in flight."""
    pair = dspark.load_model("tiny", device="cuda")
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    draft = dict(draft_tokens=3, drafter=pair.dspark)
    sync, sync_trace, sync_stats, _ = _run(pair, prompts, 40, overlap=False, **draft)
    counts = _count_launches(monkeypatch)
    ahead, ahead_trace, ahead_stats, engine = _run(pair, prompts, 40, overlap=True, **draft)
    assert ahead == sync and ahead_trace == sync_trace and ahead_stats == sync_stats
    assert engine.runner.graphs and engine.static_draft.propose_graphs
    assert 0 < counts["host"] < counts["all"] - counts["host"]
