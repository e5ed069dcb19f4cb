"""`static_decode` with an `MtpDrafter`: the rounds draft and observe MTP on the static slots
(`dspark.engine.static_mtp_draft`), never with the dynamic `MtpDrafter.propose`, and give the tokens of
per-request `dspark.generate` (tiny-v4, fp32, CPU, eager); slots are never leaked."""

import json
import sys
from importlib import resources
from pathlib import Path

import pytest

import dspark
from dspark.draft import MtpDrafter
from dspark.engine import Engine, EngineConfig
from dspark.engine.static_mtp_draft import StaticMtpRunner
from dspark.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the static-path test helpers
from test_engine_static import LIMITS, _check_slots, _prompts, random_traffic  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


@pytest.fixture
def no_dynamic_mtp_propose(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("static_decode drafted with the dynamic MtpDrafter.propose")

    return lambda: monkeypatch.setattr(MtpDrafter, "propose", forbidden)


@pytest.mark.parametrize("block_size, budget", [(1, 1), (2, "auto")])
def test_static_mtp_rounds_give_the_tokens_of_generate(tiny, block_size, budget, no_dynamic_mtp_propose):
    """Greedy requests of different prompt lengths, two admitted per step with 3 running at most (so
    slots are reused, compacted by moves and stepped in buckets of 1, 2 and 3 slots): each request's
    tokens equal `dspark.generate` of its prompt alone with the same MTP drafter (dynamic path); MTP-1
    verifies its draft every round, and drafts are accepted."""
    prompts, new = _prompts(6, seed=21), 14
    reference = [dspark.generate(tiny, p, max_new_tokens=new, draft_tokens=budget,
                                 drafter=MtpDrafter(tiny, block_size=block_size)).token_ids for p in prompts]
    no_dynamic_mtp_propose()
    engine = Engine(tiny, EngineConfig(max_running=3, prefill_chunk=7, static_decode=True, draft_tokens=budget,
                                       drafter=MtpDrafter(tiny, block_size=block_size), trace=True, **LIMITS))
    # a fixed budget runs its greedy rounds in flight (DraftLookahead); "auto" stays synchronous for MTP
    assert isinstance(engine.static_draft, StaticMtpRunner) and (engine.draft_ahead is None) == (budget == "auto")
    moves, move = [], engine.runner.move
    engine.runner.move = lambda src, dst: (moves.append((src, dst)), move(src, dst))
    tokens, pending = {}, list(enumerate(prompts))
    while pending or engine.has_work():
        for _ in range(min(2, len(pending))):
            i, p = pending.pop(0)
            engine.add_request(p, SamplingParams(), new, request_id=f"r{i}")
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
        _check_slots(engine)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert moves and engine.slots.free == engine.slots.slots
    trace = engine.take_trace()
    assert all(r["confidence_logits"] is None for r in trace)  # no confidence head, as on the dynamic path
    assert sum(r["accepted"] for r in trace) > 0
    if budget == 1:
        assert all(r["verified"] == min(1, r["verified"]) and len(r["draft"]) == 1 for r in trace)


def test_sampled_rounds_run_on_the_static_drafter_and_greedy_rows_keep_their_tokens(tiny, no_dynamic_mtp_propose):
    """Mixed batches (T = 0.8 and greedy) draft in one static propose with per-slot temperatures: the
    greedy requests' tokens equal their greedy-only run, every sampled request finishes with tokens in
    the vocabulary, and MTP drafts of sampled requests are accepted (their q is used)."""
    prompts, new = _prompts(4, seed=22), 12
    greedy_only = dspark.generate(tiny, prompts[::2], max_new_tokens=new, draft_tokens=1, drafter=MtpDrafter(tiny))
    no_dynamic_mtp_propose()
    engine = Engine(tiny, EngineConfig(max_running=4, static_decode=True, draft_tokens=1, drafter=MtpDrafter(tiny),
                                       trace=True, **LIMITS))
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i), new, request_id=f"r{i}")
    tokens = {}
    while engine.has_work():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
    assert [tokens["r0"], tokens["r2"]] == [o.token_ids for o in greedy_only]
    assert all(0 <= t < tiny.config.vocab_size for i in (1, 3) for t in tokens[f"r{i}"])
    trace = engine.take_trace()
    assert sum(r["accepted"] for r in trace if r["temperature"] > 0) > 0


def test_random_admit_finish_abort_preempt_never_leak_mtp_slots(tiny):
    """Random arrivals, aborts, finishes and, with a tight state budget, preemptions (a preempted request
    re-prefills its MTP state and loads it into its new slot): the held slots are exactly the decoding
    requests' after every step, and all are free at the end."""
    engine = Engine(tiny, EngineConfig(max_running=3, max_waiting=6, prefill_chunk=5, draft_tokens=1,
                                       drafter=MtpDrafter(tiny), state_budget_bytes=100 * 1024, page_bytes=1024,
                                       static_decode=True, **LIMITS))
    preemptions, decoded = random_traffic(engine, steps=60, seed=5)
    assert engine.slots.free == engine.slots.slots and not engine.slots.holder_slots()
    allocator = engine.scheduler.allocator
    allocator.check()
    assert not allocator.owners() and allocator.pool.free == allocator.pool.num_pages
    assert preemptions > 0 and decoded > 0


def test_mtp_rounds_in_flight_equal_the_synchronous_static_engine(tiny, monkeypatch):
    """MTP-1 at budget 1 with `overlap`: greedy rounds chained on the device (`DraftLookahead` over the
    `StaticMtpRunner`) give the synchronous static engine's tokens, statistics and trace records (no
    confidence logits, as MTP has no head); most rounds come from the round in flight; no slot leaks."""
    from dspark.engine.draft_lookahead import DraftLookahead

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_engine_lookahead import count_launches

    prompts, new = _prompts(5, seed=23), 18

    def run(overlap):
        engine = Engine(tiny, EngineConfig(max_running=3, static_decode=True, overlap=overlap, draft_tokens=1,
                                           drafter=MtpDrafter(tiny), trace=True, **LIMITS))
        assert isinstance(engine.draft_ahead, DraftLookahead) == overlap
        tokens, stats, pending = {}, {}, list(enumerate(prompts))
        while pending or engine.has_work():
            if pending:
                i, p = pending.pop(0)
                engine.add_request(p, SamplingParams(), new, request_id=f"r{i}")
            for event in engine.step():
                tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
                if event.finished:
                    stats[event.request_id] = (event.stats.rounds, event.stats.accept_hist)
            _check_slots(engine)
        assert engine.slots.free == engine.slots.slots
        return tokens, stats, engine.take_trace()

    counts = count_launches(monkeypatch, DraftLookahead)
    ahead = run(True)
    assert 0 < counts["host"] < counts["all"] - counts["host"]  # most rounds were chained
    sync = run(False)
    assert ahead[0] == sync[0] and ahead[1] == sync[1]
    assert [{k: v for k, v in r.items() if k != "confidence"} for r in ahead[2]] == \
        [{k: v for k, v in r.items() if k != "confidence"} for r in sync[2]]
    assert all(r["confidence_logits"] is None and r["confidence"] == pytest.approx(s["confidence"])
               for r, s in zip(ahead[2], sync[2]))
