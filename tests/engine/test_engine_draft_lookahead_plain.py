"""`draft_tokens="auto"` with the round in flight (`DraftLookahead`, planner "async") may choose budget 0:
a plain greedy step with no propose whose target features the static drafter still observes, so the
next drafting round drafts from a current context.

A hand-made capacity table makes plain steps pay from 3 requests up and drafting pay at 1 or 2, so a
run where requests arrive and finish switches both ways. Checked:
* tokens equal plain greedy `generate` and a synchronous engine (which drafts every round) verifying
  the same budgets; every drafting round's drafts and confidences equal that engine's (the drafter's
  context after plain rounds is what observing every committed token gives), so do statistics; after
  every step each request's draft context keys equal that engine's bit for bit;
* plain rounds call no `propose` and one `observe`; each budget follows the two-back rule; a round
  chained behind one of the other kind switches either way (nothing in flight is dropped for it);
* no slot or page is left held;
* a steady plain round runs no more eager tensor ops than a plain engine's step (besides the target step
  and the observe: no draft, accept, mask or confidence work, no planning over unchanged rows) and
  copies only the bonus tokens to the host.
On the CPU the rounds run eagerly and in order: the logic the GPU runs, not the overlap itself."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import dspark
from torch.utils._python_dispatch import TorchDispatchMode

from dspark.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from dspark.verify.planner import uniform_budget

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the round-in-flight helpers
from test_engine_draft_lookahead_auto import _replay_budgets, _rule, _spy_budgets, same_rounds  # noqa: E402

TEXTS = ["def read_config(path):\n    ", "ROMEO.\nBut soft, what light through yonder",
         "class Cache:\n    def __init__(self, size):\n", "KING.\nNow, my good lords,"]
NEW = (36, 10, 14, 24)  # request 0 alone first; 1-3 join after `JOIN` steps and finish one by one
JOIN = 3
# One step time up to B = 4 batch tokens, 1000x that from B = 5: R = 1 drafts up to 3, R = 2 one draft,
# R >= 3 decodes plain (any draft puts B past 4); every confidence > 0 makes drafting pay below that.
TABLE = CapacityTable((1, 4, 5), (1.0, 1.0, 1e-3), "hand-made: plain pays from 3 requests")


@pytest.fixture(scope="module")
def pair():
    return dspark.load_model("tiny")


def test_table_forces_plain_from_three_requests():
    gamma, c = 5, [0.5] * 5
    assert [uniform_budget([c] * r, gamma, TABLE, min_budget=0) for r in (1, 2, 3, 4)] == [3, 1, 0, 0]
    assert uniform_budget([None] * 4, gamma, TABLE, min_budget=0) == 0  # new requests too


def _spy_launches(engine) -> list:
    """(budget, chained, propose calls, observe calls) of every round `engine.draft_ahead` launches
    (chained: from the round before it, on the device, rather than from host values)."""
    launches, drafting = [], engine.static_draft
    propose, observe, launch = drafting.propose, drafting.observe, engine.draft_ahead._launch
    calls = {"propose": 0, "observe": 0}

    def counted(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)
        return wrapped

    def launching(key, n, *args):
        before = dict(calls)
        result = launch(key, n, *args)
        launches.append((n, key is None, calls["propose"] - before["propose"], calls["observe"] - before["observe"]))
        return result

    drafting.propose, drafting.observe = counted("propose", propose), counted("observe", observe)
    engine.draft_ahead._launch = launching
    return launches


def _engine(model, overlap):
    return Engine(model, EngineConfig(max_running=4, static_decode=True, overlap=overlap, trace=True,
                                      max_prompt_tokens=64, max_new_tokens=64, drafter=model.dspark,
                                      draft_tokens="auto", planner="async", capacity=TABLE))


def _arrive(engine, model, step: int) -> None:
    """Request 0 at step 0, requests 1-3 at step `JOIN`."""
    first, last = (0, 1) if step == 0 else (1, len(TEXTS)) if step == JOIN else (0, 0)
    for i in range(first, last):
        engine.add_request(model.tokenizer.encode(TEXTS[i]), SamplingParams(), NEW[i], request_id=f"r{i}")


def _run(model, overlap):
    engine = _engine(model, overlap)
    launches = _spy_launches(engine) if overlap else None
    tokens, stats, step = {}, {}, 0
    rids = [f"r{i}" for i in range(len(TEXTS))]
    while step == 0 or engine.has_work():
        _arrive(engine, model, step)
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                s = event.stats
                stats[event.request_id] = (s.rounds, s.verified_tokens, s.new_tokens, s.accept_hist)
        step += 1
    assert engine.slots.free == engine.slots.slots and not engine.slots.holder_slots()  # no slot leak
    assert engine.scheduler.allocator.pool.used == 0 and not engine.scheduler.allocator.owners()  # no page leak
    engine.scheduler.allocator.check()
    return [tokens[r] for r in rids], engine.take_trace(), [stats[r] for r in rids], engine, launches


def test_plain_rounds_in_flight_switch_both_ways_and_stay_exact(pair, monkeypatch):
    budgets = _spy_budgets(monkeypatch)
    ahead, ahead_trace, ahead_stats, engine, launches = _run(pair, overlap=True)
    assert engine.draft_ahead.pending is None
    expected = [dspark.generate(pair, t, max_new_tokens=n).token_ids for t, n in zip(TEXTS, NEW)]
    assert ahead == expected  # plain greedy, token for token
    n = [b for b, _ in budgets]
    assert 0 in n and max(n) >= 2
    switches = {(a > 0, b > 0) for a, b in zip(n, n[1:]) if (a > 0) != (b > 0)}
    assert switches == {(True, False), (False, True)}  # drafting -> plain -> drafting
    # A plain round drafts nothing and observes its one row; a drafting round proposes once.
    assert {(p, o) for b, _, p, o in launches if b == 0} == {(0, 1)}
    assert {(p, o) for b, _, p, o in launches if b > 0} == {(1, 1)}
    assert sum(1 for b, chained, _, _ in launches if b == 0 and chained) > 10
    # Each round's budget is the rule over the newest drafting round at or before its round j − 2.
    assert n == _rule(budgets, ahead_trace, 2, pair.dspark.block_size, TABLE)
    # The synchronous engine drafts in every round and verifies the same budgets: same tokens and
    # statistics, and every drafting round (drafts and confidences come from the drafter's context, so
    # also those right after plain rounds) is the same record.
    _replay_budgets(monkeypatch, ahead_trace)
    sync, sync_trace, sync_stats, sync_engine, _ = _run(pair, overlap=False)
    assert sync_engine.draft_ahead is None
    assert ahead == sync and ahead_stats == sync_stats and same_rounds(ahead_trace, sync_trace, pair.dspark.block_size)
    rounds = {}
    for record in ahead_trace:
        rounds.setdefault(record["request_id"], []).append(record)
    after_plain = sum(1 for rs in rounds.values() for a, b in zip(rs, rs[1:]) if not a["draft"] and b["draft"])
    assert after_plain >= 2  # drafting rounds right after plain ones were compared


def test_a_long_plain_run_probes_and_stays_exact(pair, monkeypatch):
    """Four requests from the start: the batch decodes plain, and after PLAIN_PROBE_EVERY plain rounds,
    then twice and four times as many (each probe found plain decoding better), a round is the plain
    probe (budget 1, drafting two slots), which the two-back rule with the probe reproduces; the tokens
    are plain greedy's."""
    from dspark.engine.draft_lookahead import PLAIN_PROBE_EVERY

    budgets = _spy_budgets(monkeypatch)
    engine = _engine(pair, overlap=True)
    rids = [engine.add_request(pair.tokenizer.encode(t), SamplingParams(), 60) for t in TEXTS]
    tokens = {rid: [] for rid in rids}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
    trace = engine.take_trace()
    n = [b for b, _ in budgets]
    assert [tokens[r] for r in rids] == [o.token_ids for o in dspark.generate(pair, TEXTS, max_new_tokens=60)]
    assert n == _rule(budgets, trace, 2, pair.dspark.block_size, TABLE)
    probes = [i for i, b in enumerate(n) if b == 1 and i >= PLAIN_PROBE_EVERY and not any(n[i - PLAIN_PROBE_EVERY:i])]
    assert len(probes) >= 2
    assert all(b - a == (PLAIN_PROBE_EVERY << k) + 1 for k, (a, b) in enumerate(zip(probes, probes[1:]), 1))
    # each probe drafted two slots for each of the four requests (other rounds verifying one draft may
    # be synchronous ones near the end, which draft the whole block)
    assert sum(1 for r in trace if r["verified"] == 1 and len(r["draft"]) == 2) >= 4 * len(probes)
    assert engine.scheduler.allocator.pool.used == 0 and engine.slots.free == engine.slots.slots


def _context(engine, req) -> list[torch.Tensor]:
    """Per drafter stage the context keys [W, d] that request `req` (holding a static slot) drafts from
    at its committed length: positions length − W .. length − 1 of its slot's ring (zero before 0)."""
    engine.static_draft.flush()  # the rings after the last plain rounds' deferred rows
    state, slot = engine.static_draft.static.state, req.state.slot
    anchors = torch.zeros(slot + 1, dtype=torch.long, device=engine.static_draft.static.device)
    anchors[slot] = req.state.length
    rows = state.context_index(anchors)[slot]  # [W]
    return [torch.where((rows >= 0)[:, None], pool[rows.clamp(min=0)], 0) for pool in state.pools()]


def test_drafter_context_after_plain_rounds_is_the_always_drafting_one(pair, monkeypatch):
    """After every step, every decoding request's draft context (the keys its next block attends to)
    equals, bit for bit, that of the synchronous engine which drafted in every round and verified the
    same budgets: plain rounds observed every committed token, and nothing else is visible."""
    _check_context(pair, monkeypatch)


@pytest.mark.gpu
def test_drafter_context_after_deferred_observes_on_cuda(monkeypatch):
    """On CUDA plain rounds copy their rows into the (b, T) observe graph's inputs, in flight or not:
    after every step the draft contexts still equal the synchronous engine's bit for bit."""
    model = dspark.load_model("tiny", device="cuda")
    _check_context(model, monkeypatch)


def _check_context(pair, monkeypatch):
    _, trace, _, _, _ = _run(pair, overlap=True)  # the budgets, replayed below
    _replay_budgets(monkeypatch, trace)
    ahead, sync = _engine(pair, overlap=True), _engine(pair, overlap=False)
    step, after_plain = 0, 0
    while step == 0 or ahead.has_work():
        for engine in (ahead, sync):
            _arrive(engine, pair, step)
            engine.step()
        plain = {r["request_id"]: not r["draft"] for r in ahead._trace}  # each request's latest round
        for req in ahead.running:
            twin = next(r for r in sync.running if r.request_id == req.request_id)
            if req.stats.rounds == 0:
                continue  # not decoding yet: no slot
            assert (req.state.slot, req.state.length) == (twin.state.slot, twin.state.length)
            assert all(torch.equal(a, s) for a, s in zip(_context(ahead, req), _context(sync, twin)))
            after_plain += plain[req.request_id]
        step += 1
    assert not sync.has_work() and after_plain > 20
    return ahead


def test_rounds_chained_behind_the_other_kind(pair):
    """With the batch unchanged, a switch happens on the round in flight: the host-launched round reads
    the older stale rows, the round chained behind it the newer ones (set by hand: all-zero survival
    gives a plain round, all-one a drafting one), and the next step uses that chained round as it is."""
    engine = Engine(pair, EngineConfig(max_running=2, static_decode=True, overlap=True, max_prompt_tokens=64,
                                       max_new_tokens=64, drafter=pair.dspark, draft_tokens="auto",
                                       planner="async", capacity=TABLE))
    launches = _spy_launches(engine)
    rids = [engine.add_request(pair.tokenizer.encode(t), SamplingParams(), 30) for t in TEXTS[:2]]
    tokens = {rid: [] for rid in rids}

    def step():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids

    while len(engine.running) < 2 or any(r.stats.rounds < 1 for r in engine.running):
        step()
    gamma = pair.dspark.block_size
    zero, one = torch.zeros(gamma), torch.ones(gamma)
    assert [uniform_budget([c, c], gamma, TABLE, min_budget=0) for c in (zero, one)] == [0, 1]
    for older, newer, budgets in ((zero, one, [0, 1]), (one, zero, [1, 0])):  # plain -> drafting and back
        for req in engine.running:
            req.confidences.extend([older, newer])  # [round k − 2, round k − 1]
        engine.draft_ahead.discard()
        launches.clear()
        step()  # round k from the host, round k + 1 chained behind it
        step()  # round k + 1 as it was launched; round k + 2 chained
        assert [(n, chained) for n, chained, _, _ in launches[:2]] == [(budgets[0], False), (budgets[1], True)]
        assert len(launches) == 3 and launches[2][1]  # the second step launched nothing from the host
    while engine.has_work():
        step()
    assert [tokens[r] for r in rids] == [o.token_ids for o in dspark.generate(pair, TEXTS[:2], max_new_tokens=30)]


def test_plain_rounds_keep_the_last_confidences(pair):
    """While no drafts are made a request keeps its last known confidences: each plain round appends the
    last row again (so the rows two rounds back are the newest drafting round's, however the round was
    launched); a request that never drafted keeps none (survival 1)."""
    engine = Engine(pair, EngineConfig(max_running=4, static_decode=True, overlap=True, max_prompt_tokens=64,
                                       max_new_tokens=64, drafter=pair.dspark, draft_tokens="auto",
                                       planner="async", capacity=TABLE))
    first = engine.add_request(pair.tokenizer.encode(TEXTS[0]), SamplingParams(), 40)
    while not engine.running or len(engine.running[0].confidences) < 2:
        engine.step()  # alone: drafting rounds
    for text in TEXTS[1:3]:
        engine.add_request(pair.tokenizer.encode(text), SamplingParams(), 40)
    while any(r.stats.rounds < 3 for r in engine.running):
        engine.step()  # three requests: plain rounds only
    req = next(r for r in engine.running if r.request_id == first)
    verified, rounds = req.stats.verified_tokens, req.stats.rounds
    last = req.confidences[-1].clone()
    for _ in range(3):
        engine.step()
    assert req.stats.rounds == rounds + 3 and req.stats.verified_tokens == verified  # plain rounds
    assert len(req.confidences) == 2 and all(torch.equal(c, last) for c in req.confidences)
    assert all(not r.confidences for r in engine.running if r is not req)


class _EagerOps(TorchDispatchMode):
    """Counts the aten ops run outside `paused` calls (the graphs on CUDA: the target step, the observe)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def pause(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def paused(*args):
            self.paused += 1
            try:
                return fn(*args)
            finally:
                self.paused -= 1
        setattr(obj, name, paused)


def _steady_ops(engine, graphs, steps=3) -> Counter:
    """Eager ops of `steps` engine steps of 3 requests that all decode (the first of them drafted alone
    first, so it holds confidences), outside the `graphs` calls."""
    engine.add_request(engine.model.tokenizer.encode(TEXTS[0]), SamplingParams(), 40)
    while not engine.running or engine.running[0].stats.rounds < 3:
        engine.step()
    for text in TEXTS[1:3]:
        engine.add_request(engine.model.tokenizer.encode(text), SamplingParams(), 40)
    while len(engine.running) < 3 or any(r.stats.rounds < 3 for r in engine.running):
        engine.step()
    mode = _EagerOps()
    for obj, name in graphs:
        mode.pause(obj, name)
    with mode:
        for _ in range(steps):
            engine.step()
    return mode.ops


def test_a_plain_round_costs_no_more_eager_ops_than_a_plain_step(pair):
    """In a batch that went plain, a round (from the round in flight) runs the target's width-1 step and
    the drafter's observe plus at most the eager ops of a plain engine's step in flight: the argmax, the
    next inputs, the token copy; no draft, acceptance, mask or confidence op and no planning (the stale
    rows are the same each round). Its host copy is the bonus [b] only."""
    auto = _engine(pair, overlap=True)
    plain = Engine(pair, EngineConfig(max_running=4, static_decode=True, overlap=True, trace=True,
                                      max_prompt_tokens=64, max_new_tokens=64))
    rounds = []
    launch = auto.draft_ahead._launch

    def launching(key, n, *args):
        rounds.append(launch(key, n, *args))
        return rounds[-1]
    auto.draft_ahead._launch = launching
    auto_ops = _steady_ops(auto, [(auto.runner, "step"), (auto.static_draft, "observe")])
    plain_ops = _steady_ops(plain, [(plain.runner, "step")])
    steady = rounds[-3:]
    assert [r.budget for r in steady] == [0, 0, 0] and auto.running[0].confidences  # rows held, planned over
    assert all(r.host_conf is None and r.host_ids.shape == r.live.shape for r in steady)
    assert sum(auto_ops.values()) <= sum(plain_ops.values()), (auto_ops, plain_ops)
    assert not {"cumprod", "cat", "stack", "gather", "eq"} & set(auto_ops), auto_ops


@pytest.mark.gpu
def test_plain_rounds_in_flight_on_cuda_graphs(monkeypatch):
    """On CUDA a plain round replays the width-1 step graph (its rows reach the drafter in one (bucket, T)
    observe graph per T plain rounds or at the next drafting round), chained
    behind the round before it like a drafting round: plain greedy tokens, switches both ways, the same
    drafting rounds as the synchronous engine."""
    pair = dspark.load_model("tiny", device="cuda")
    budgets = _spy_budgets(monkeypatch)
    ahead, ahead_trace, ahead_stats, engine, launches = _run(pair, overlap=True)
    assert engine.runner.graphs and engine.static_draft.observe_graphs
    assert ahead == [dspark.generate(pair, t, max_new_tokens=n).token_ids for t, n in zip(TEXTS, NEW)]
    n = [b for b, _ in budgets]
    assert {(a > 0, b > 0) for a, b in zip(n, n[1:]) if (a > 0) != (b > 0)} == {(True, False), (False, True)}
    assert {(p, o) for b, _, p, o in launches if b == 0} == {(0, 1)}
    _replay_budgets(monkeypatch, ahead_trace)
    sync, sync_trace, sync_stats, _, _ = _run(pair, overlap=False)
    assert ahead == sync and ahead_stats == sync_stats and same_rounds(ahead_trace, sync_trace, pair.dspark.block_size)
