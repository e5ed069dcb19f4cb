"""`EngineConfig(draft_tokens="auto", planner="async", overlap=True)` with a static DSpark drafter: greedy
rounds keep one round in flight, each at one budget for the whole batch chosen from confidences two
rounds old (`DraftLookahead(..., "auto", capacity)`, `planner.uniform_budget`; budget 0, a plain round:
tests/engine/test_engine_draft_lookahead_plain.py).

* greedy output equals plain greedy decoding token for token, most rounds coming from the round in flight;
* every such round's budget is the rule over the confidences the trace recorded for each request's
  round j − 2, and neither its round j − 1 nor its own round j (the rule would differ);
* tokens, statistics and traces equal a synchronous engine that verifies the same budget in every round
  (trained pair; random pair under staggered arrivals, finishes, slot moves and buckets, where the
  random drafter's low confidences make some rounds plain: no draft, no confidences in their records);
* bad planner / budget combinations raise ValueError naming the value.
On the CPU the rounds run eagerly and in order: the logic the GPU runs, not the overlap itself."""

import sys
from pathlib import Path

import pytest
import torch

import dspark
import dspark.round
from dspark.engine import Engine, EngineConfig
from dspark.engine.draft_lookahead import PLAIN_PROBE_BACKOFF, PLAIN_PROBE_EVERY, DraftLookahead
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from dspark.verify.planner import VerifyPlan, uniform_budget

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the static-engine helpers
from test_engine_lookahead import count_launches  # noqa: E402
from test_engine_static import _drafters, _prompts, _staggered  # noqa: E402

TEXTS = ["def read_config(path):\n    ", "ROMEO.\nBut soft, what light through yonder",
         "class Cache:\n    def __init__(self, size):\n", "KING.\nNow, my good lords,"]
# 20 ms + 2 ms per batch token: with the trained pair's greedy confidences (sts-greedy.json) the budget
# moves between budgets (the synthetic CPU table's 0.5 ms per token keeps it at 5).
TABLE = CapacityTable(tuple(2**i for i in range(11)), tuple(1.0 / (0.020 + 0.002 * 2**i) for i in range(11)),
                      "test: 20 ms + 2 ms per batch token")
AUTO = dict(draft_tokens="auto", planner="async", capacity=TABLE)


@pytest.fixture(scope="module")
def pair():
    return dspark.load_model("tiny")




def _spy_budgets(monkeypatch) -> list:
    """Every round `DraftLookahead` runs: (its budget, [(request id, the request's round index)])."""
    calls = []
    step = DraftLookahead.step

    def spying(self, requests):
        rounds = [(r.request_id, r.stats.rounds) for r in requests]
        n, results = step(self, requests)
        calls.append((n, rounds))
        return n, results

    monkeypatch.setattr(DraftLookahead, "step", spying)
    return calls


def _replay_budgets(monkeypatch, trace: list) -> None:
    """Make the synchronous round verify what `trace` says each request verified in that round."""
    verified = {(r["request_id"], r["round"]): r["verified"] for r in trace}
    # the synchronous round drafts every round (no budget fixed before drafting, no plain round of its own)
    monkeypatch.setattr(dspark.round, "_budget_before_drafting", lambda live, cfg, drafter: (None, False))
    monkeypatch.setattr(dspark.round, "_plan", lambda live, confidence, cfg, gamma, budget: VerifyPlan(
        tuple(verified[r.request_id, r.stats.rounds] for r in live)))


def same_rounds(ahead_trace: list, sync_trace: list, gamma: int) -> bool:
    """Whether the round-in-flight trace equals the synchronous one that replayed its budgets: record for
    record, except that a plain round (budget 0, nothing drafted: `draft` empty) has no draft or
    confidences where the synchronous round drafted a block and verified none of it, and a drafting
    round in flight verifying n drafted only the first n slots of the synchronous round's block, or
    min(n + 1, γ) on a probe round."""
    def same(a: dict, s: dict) -> bool:
        if not a["draft"]:
            return a == dict(s, draft=[], confidence=[], confidence_logits=None) and a["verified"] == 0
        w = len(a["draft"])  # γ where the round ran synchronously (the first, or after a batch change)
        if w not in (a["verified"], min(a["verified"] + 1, gamma), gamma):
            return False
        # the confidence head ran over w instead of γ rows per block: equal up to the matmul's rounding
        near = {key: (a[key], None if s[key] is None else s[key][:w]) for key in ("confidence", "confidence_logits")}
        return a["draft"] == s["draft"][:w] and all(
            (x is None) == (y is None) and (x is None or x == pytest.approx(y, rel=1e-5, abs=1e-6))
            for x, y in near.values()) and {k: v for k, v in a.items() if k not in near} == \
            {k: v for k, v in s.items() if k not in near and k != "draft"} | {"draft": a["draft"]}

    return len(ahead_trace) == len(sync_trace) and all(same(a, s) for a, s in zip(ahead_trace, sync_trace))


def _rule(calls: list, trace: list, lag: int, gamma: int, table=TABLE,
          plain_probe_every: int | None = PLAIN_PROBE_EVERY, prior=None) -> list[int]:
    """The budget of every recorded round (0 allowed: a plain round) from the confidences of each
    request's round j − lag as the trace recorded them, or of its newest drafting round before that
    when round j − lag drafted nothing (a plain round keeps the last confidences); `prior` before any.
    After `plain_probe_every` plain rounds in a row a 0 becomes 1 (the plain probe), the wait doubling
    with each probe since the last other drafting round, up to PLAIN_PROBE_BACKOFF times."""
    conf = {(r["request_id"], r["round"]): r["confidence"] for r in trace if r["confidence"]}

    def stale(rid: str, j: int):
        return next((conf[rid, i] for i in range(j - lag, -1, -1) if (rid, i) in conf), prior)

    budgets, run, probes = [], 0, 0
    for _, rounds in calls:
        n = uniform_budget([stale(rid, j) for rid, j in rounds], gamma, table, min_budget=0)
        probe = n == 0 and plain_probe_every is not None and \
            run >= plain_probe_every * min(1 << probes, PLAIN_PROBE_BACKOFF)
        n = 1 if probe else n
        run = run + 1 if n == 0 else 0
        probes = (probes + 1 if probe else 0) if n else probes
        budgets.append(n)
    return budgets


def _run(model, new, **config):
    engine = Engine(model, EngineConfig(max_running=4, static_decode=True, trace=True, max_prompt_tokens=64,
                                        max_new_tokens=64, drafter=model.dspark, **AUTO, **config))
    rids = [engine.add_request(model.tokenizer.encode(t), SamplingParams(), new) for t in TEXTS]
    tokens, stats = {rid: [] for rid in rids}, {}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
            if event.finished:
                s = event.stats
                stats[event.request_id] = (s.rounds, s.verified_tokens, s.new_tokens, s.accept_hist)
    assert engine.slots.free == engine.slots.slots
    return [tokens[rid] for rid in rids], engine.take_trace(), [stats[rid] for rid in rids], engine


def test_auto_rounds_in_flight_give_plain_greedy(pair, monkeypatch):
    counts = count_launches(monkeypatch, DraftLookahead)
    calls = _spy_budgets(monkeypatch)
    tokens, trace, _, engine = _run(pair, 40, overlap=True)
    assert isinstance(engine.draft_ahead, DraftLookahead) and engine.draft_ahead.budget == "auto"
    assert tokens == [o.token_ids for o in dspark.generate(pair, TEXTS, max_new_tokens=40)]
    assert 0 < counts["host"] < counts["all"] - counts["host"]  # most rounds came from the round in flight
    assert len({n for n, _ in calls}) > 2  # the budget is chosen per round
    assert engine.draft_ahead.pending is None


def test_each_budget_is_the_rule_over_confidences_two_rounds_old(pair, monkeypatch):
    calls = _spy_budgets(monkeypatch)
    _, trace, _, _ = _run(pair, 40, overlap=True)
    rule = lambda lag: _rule(calls, trace, lag, pair.dspark.block_size)  # noqa: E731
    assert len(calls) > 10
    assert [n for n, _ in calls] == rule(2)
    assert rule(1) != rule(2) and rule(0) != rule(2)  # the test tells fresher confidences apart


def test_a_request_without_stale_rows_is_planned_with_the_calibration_prior(pair, monkeypatch):
    """A request's first rounds in flight read its drafter's greedy calibration acceptance, as on the
    dynamic path: a prior that says drafts rarely survive makes them plain rounds, where survival 1
    (no prior) drafted; output stays plain greedy decoding's."""
    import dataclasses

    gamma = pair.dspark.block_size
    calls = _spy_budgets(monkeypatch)
    low = dataclasses.replace(pair.dspark.greedy_calibration, acceptance=(0.02,) * gamma)
    monkeypatch.setattr(pair.dspark, "greedy_calibration", low)
    tokens, trace, _, engine = _run(pair, 24, overlap=True)
    prior = engine.draft_ahead.prior
    assert prior.tolist() == pytest.approx(low.acceptance)
    assert tokens == [o.token_ids for o in dspark.generate(pair, TEXTS, max_new_tokens=24)]
    budgets = [n for n, _ in calls]
    assert budgets == _rule(calls, trace, 2, gamma, prior=prior) != _rule(calls, trace, 2, gamma)
    assert budgets[0] == 0 and _rule(calls[:1], trace, 2, gamma)[0] > 0


def test_the_next_budget_is_planned_after_the_commit(pair, monkeypatch):
    """The engine plans the round after the one in flight once it has committed a round
    (`DraftLookahead.prepare`, while the device runs): a step whose batch and round in flight stayed
    the same launches that round without running the planner (`uniform_budget`), with the budgets of
    the rule (test above)."""
    import dspark.engine.draft_lookahead as lookahead

    where, inside = [], [False]
    rule, step = lookahead.uniform_budget, DraftLookahead.step
    monkeypatch.setattr(lookahead, "uniform_budget", lambda *a, **k: where.append(inside[0]) or rule(*a, **k))
    steady = []  # planner calls inside each step that found its batch and its round in flight unchanged

    def stepping(self, requests):
        same = self.pending is not None and self.pending.key == tuple(
            (r.request_id, r.state.slot, r.state.length) for r in requests)
        inside[0], before = True, len(where)
        try:
            return step(self, requests)
        finally:
            inside[0] = False
            if same:
                steady.append(len(where) - before)

    monkeypatch.setattr(DraftLookahead, "step", stepping)
    tokens, _, _, _ = _run(pair, 60, overlap=True)
    assert tokens == [o.token_ids for o in dspark.generate(pair, TEXTS, max_new_tokens=60)]
    assert len(steady) > 10 and set(steady) == {0}
    assert where.count(False) >= len(steady)  # planned after the commits instead


def test_host_launched_and_chained_rounds_read_their_own_two_back_rows(pair):
    """A round launched from the host (k) reads the older of the two confidence rows read so far (round
    k − 2), the round chained behind it (k + 1) the newer one (round k − 1): set them apart by hand."""
    engine = Engine(pair, EngineConfig(max_running=2, static_decode=True, overlap=True, drafter=pair.dspark,
                                       max_prompt_tokens=64, max_new_tokens=64, **AUTO))
    for text in TEXTS[:2]:
        engine.add_request(pair.tokenizer.encode(text), SamplingParams(), 40)
    while len(engine.running) < 2 or not all(len(r.confidences) == 2 for r in engine.running):
        engine.step()
    gamma = pair.dspark.block_size
    old, new = torch.full((gamma,), 0.3), torch.ones(gamma)
    low, high = (uniform_budget([c, c], gamma, TABLE, min_budget=0) for c in (old, new))
    assert (low, high) == (1, gamma)
    for req in engine.running:
        req.confidences.extend([old, new])  # [round k − 2, round k − 1]
    engine.draft_ahead.discard()
    assert engine.draft_ahead.fits(engine.running)
    n, _ = engine.draft_ahead.step(engine.running)
    assert n == low and engine.draft_ahead.pending.budget == high


def test_auto_rounds_in_flight_equal_synchronous_rounds_of_the_same_budgets(pair, monkeypatch):
    ahead, ahead_trace, ahead_stats, _ = _run(pair, 40, overlap=True)
    _replay_budgets(monkeypatch, ahead_trace)
    sync, sync_trace, sync_stats, engine = _run(pair, 40, overlap=False)
    assert engine.draft_ahead is None
    assert ahead == sync and same_rounds(ahead_trace, sync_trace, pair.dspark.block_size) and ahead_stats == sync_stats
    assert len({r["verified"] for r in ahead_trace}) > 2 and len({r["accepted"] for r in ahead_trace}) > 2
    # rounds in flight drafted their budget, probe rounds one slot past it, not the whole block
    gamma = pair.dspark.block_size
    assert any(len(r["draft"]) == r["verified"] + 1 < gamma for r in ahead_trace)
    assert any(0 < len(r["draft"]) == r["verified"] < gamma for r in ahead_trace)


def _lookahead(budget, probe_every=None, gamma=5, **extra):
    """A DraftLookahead over stand-ins of a runner and a static drafter (only their sizes are read)."""
    from types import SimpleNamespace

    runner = SimpleNamespace(shape=SimpleNamespace(tokens=gamma + 1))
    drafting = SimpleNamespace(static=SimpleNamespace(drafter=SimpleNamespace(block_size=gamma), n_draft=gamma),
                               flush=None)
    if probe_every is not None:
        extra["probe_every"] = probe_every
    return DraftLookahead(runner, drafting, budget, TABLE if budget == "auto" else None, **extra)


def test_plain_probe_drafts_one_after_a_run_of_plain_rounds():
    """After `plain_probe_every` plain rounds in a row a plain decision becomes budget 1, drafted a slot
    past it, and each probe in a row doubles the wait (a drafting round that is not a probe resets it);
    drafting decisions and fixed budgets are untouched; None turns the probe off."""
    from dspark.verify.capacity import CapacityTable

    plain_table = CapacityTable((1, 4, 5), (1.0, 1.0, 1e-3), "plain pays from 3 requests")
    ahead = _lookahead("auto", plain_probe_every=3)
    ahead.capacity = plain_table
    rows = [torch.full((5,), 0.5)] * 4

    def rounds(count: int) -> list[int]:  # what `step` does per round: plan it, then count it
        decisions = []
        for _ in range(count):
            decisions.append(ahead.plan(rows))
            ahead.count(decisions[-1], ahead._probe)
        return decisions

    assert rounds(24) == [0, 0, 0, 1] + [0] * 6 + [1] + [0] * 12 + [1]  # waits 3, 6, 12
    ahead.count(2, False)  # a drafting round that is not a probe: the wait is 3 again
    assert rounds(4) == [0, 0, 0, 1]
    ahead._plain_probes = 10
    assert ahead.plain_probe_wait() == 3 * PLAIN_PROBE_BACKOFF
    ahead._plain_run, ahead._plain_probes, ahead._after_plain = 3, 0, True
    assert ahead.plan(rows[:1]) == 3  # a drafting decision stands as it is
    assert ahead._width(1) == 2  # the first drafting round after a plain one drafts a slot further
    off = _lookahead("auto", plain_probe_every=None)
    off.capacity, off._plain_run = plain_table, 100
    assert off.plan(rows) == 0 and _lookahead(3, plain_probe_every=1).plan(rows) == 3
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=rf"plain_probe_every must be None or an int >= 1, got {bad!r}"):
            _lookahead("auto", plain_probe_every=bad)


def test_auto_in_flight_needs_the_dspark_drafter():
    """An MTP runner (no deferred observe, no confidence head) takes fixed budgets only."""
    from types import SimpleNamespace

    runner = SimpleNamespace(shape=SimpleNamespace(tokens=3))
    mtp = SimpleNamespace(static=SimpleNamespace(drafter=SimpleNamespace(block_size=2)))
    with pytest.raises(ValueError, match="budget 'auto' in flight needs the static DSpark drafter"):
        DraftLookahead(runner, mtp, "auto", TABLE)
    assert DraftLookahead(runner, mtp, 2).n_draft == 2


def test_auto_drafts_its_budget_and_one_past_it_every_probe_round():
    ahead = _lookahead("auto")
    assert [ahead._width(2) for _ in range(9)] == [3, 2, 2, 2, 3, 2, 2, 2, 3]  # PROBE_EVERY = 4
    assert [ahead._width(5) for _ in range(4)] == [5] * 4  # never past the drafter's k
    every = _lookahead("auto", probe_every=1)
    assert [every._width(n) for n in (1, 2, 4, 5)] == [2, 3, 5, 5]
    assert _lookahead(3)._width(3) is None  # a fixed budget drafts the drafter's n_draft
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=rf"probe_every must be an int >= 1, got {bad!r}"):
            _lookahead("auto", probe_every=bad)


def test_random_pair_under_staggered_arrivals(monkeypatch):
    model = dspark.init_model("tiny-v4", seed=0)
    config = dict(_drafters(model)["dspark_auto"], planner="async", capacity=TABLE)
    prompts, greedy = _prompts(6, seed=7), (lambda i: SamplingParams())
    calls = _spy_budgets(monkeypatch)
    ahead, ahead_trace = _staggered(model, prompts, greedy, 14, static_decode=True, overlap=True, **config)
    # Arrivals and finishes change the batch often: many rounds launch from the host, same rule.
    assert len(calls) > 10 and [n for n, _ in calls] == _rule(calls, ahead_trace, 2, config["drafter"].block_size)
    _replay_budgets(monkeypatch, ahead_trace)
    sync, sync_trace = _staggered(model, prompts, greedy, 14, static_decode=True, overlap=False, **config)
    assert ahead == sync and same_rounds(ahead_trace, sync_trace, config["drafter"].block_size)
    plain, _ = _staggered(model, prompts, greedy, 14, static_decode=False)
    assert ahead == plain


def test_bad_planner_and_budget_combinations_name_the_value(pair):
    with pytest.raises(ValueError, match="needs planner='async', got planner='sync'"):
        EngineConfig(overlap=True, draft_tokens="auto", drafter="dspark", planner="sync")
    limits = dict(max_running=2, static_decode=True, max_prompt_tokens=64, max_new_tokens=64, drafter=pair.dspark)
    # overlap=None: Algorithm 1's rounds run synchronously (no round in flight)
    assert Engine(pair, EngineConfig(draft_tokens="auto", planner="sync", **limits)).draft_ahead is None
    assert EngineConfig().planner == "async"  # the default keeps auto rounds in flight
    auto = Engine(pair, EngineConfig(overlap=True, **AUTO, **limits))
    with pytest.raises(ValueError, match="got 'uniform'"):
        DraftLookahead(auto.runner, auto.static_draft, "uniform", TABLE)
    with pytest.raises(ValueError, match="budget 'auto' needs a CapacityTable to plan with, got capacity=None"):
        DraftLookahead(auto.runner, auto.static_draft, "auto")
    fixed = Engine(pair, EngineConfig(overlap=True, draft_tokens=3, **limits))  # steps of 4 rows
    with pytest.raises(ValueError, match="budget 'auto' needs 6 rows per step; the static step takes 4"):
        DraftLookahead(fixed.runner, fixed.static_draft, "auto", TABLE)


@pytest.mark.gpu
def test_auto_rounds_in_flight_on_cuda_graphs(monkeypatch):
    """On CUDA the rounds are graph replays at the width each round's budget gives, round k + 1
    queued before round k is read: plain greedy tokens, budgets by the two-back rule."""
    pair = dspark.load_model("tiny", device="cuda")
    counts = count_launches(monkeypatch, DraftLookahead)
    calls = _spy_budgets(monkeypatch)
    tokens, trace, _, engine = _run(pair, 40, overlap=True)
    assert tokens == [o.token_ids for o in dspark.generate(pair, TEXTS, max_new_tokens=40)]
    assert engine.runner.graphs and engine.static_draft.propose_graphs
    assert 0 < counts["host"] < counts["all"] - counts["host"] and len({n for n, _ in calls}) > 1
    assert [n for n, _ in calls] == _rule(calls, trace, 2, pair.dspark.block_size)
