"""draft_tokens="auto" with the asynchronous planner on the dynamic path: the round's budget is fixed
before drafting (`dspark.round._budget_before_drafting`), a budget of 0 drafts nothing (a plain round),
plain probes come after 4, 8, 16, ... plain rounds in a row, and a calibration's acceptance is the
prior of a request without stale confidences. The output is plain greedy decoding's, token for token."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft.base import DraftProposal
from dspark.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from dspark.verify.sts import StsCalibration

GAMMA = 3
# A drafting round of B = 1 + n tokens runs at 30, 20, 15 steps/s for n = 1, 2, 3; a plain step at 50:
# a draft that survives one time in ten never pays, a request without confidences (survival 1) pays
# at n = 1 (2 tokens × 30 = 60 > 50; n = 2, 3 tie at 60, and ties go to the smaller budget).
TABLE = CapacityTable((1, 2, 3, 4), (30.0, 30.0, 20.0, 15.0), "hand-made: drafting costs", "",
                      plain_requests=(1, 8), plain_steps_per_second=(50.0, 50.0))


class LowConfidenceDrafter:
    """Drafts token 0 γ times with confidence 0.1 everywhere; counts its proposes. With `acceptance`
    it also has a calibration whose prior is that acceptance (for either kind of request)."""

    block_size = GAMMA
    capture_layers = ()

    def __init__(self, acceptance=None):
        self.proposes = 0
        self.prior = None if acceptance is None else StsCalibration((1.0,) * GAMMA, acceptance=acceptance)

    def new_state(self):
        return None

    def observe(self, dstate, token_ids, hidden, features):
        pass

    def propose(self, dstates, anchors, params, generators):
        self.proposes += 1
        shape = (len(anchors), GAMMA)
        return DraftProposal(torch.zeros(shape, dtype=torch.long), None, torch.full(shape, 0.1))

    def calibration_for(self, greedy):
        return self.prior


@pytest.fixture(scope="module")
def model():
    return dspark.init_model(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()))


def _run(model, drafter, max_new=48):
    engine = Engine(model, EngineConfig(max_running=1, draft_tokens="auto", drafter=drafter, capacity=TABLE,
                                        trace=True))
    engine.add_request(list(range(3, 19)), SamplingParams(), max_new, request_id="r")
    tokens = []
    while engine.has_work():
        for event in engine.step():
            tokens += event.new_token_ids
    return tokens, "".join(str(rec["verified"]) for rec in engine.take_trace())


def test_auto_skips_drafting_where_plain_pays_and_probes_with_backoff(model):
    drafter = LowConfidenceDrafter()
    tokens, verified = _run(model, drafter)
    # two rounds without stale confidences (survival 1: n = 1 pays), then plain; probes after 4, 8, 16
    assert verified.startswith("11" + "0000" + "1" + "0" * 8 + "1" + "0" * 16 + "1"), verified
    assert drafter.proposes == verified.count("1") + verified.count("2") + verified.count("3")
    plain = dspark.generate(model, list(range(3, 19)), max_new_tokens=48)
    assert tokens == plain.token_ids


def test_a_calibration_prior_plans_the_first_rounds(model):
    """Acceptance 0.05 as the prior: plain from the first round, the first probe after 4 plain rounds."""
    drafter = LowConfidenceDrafter(acceptance=(0.05, 0.05, 0.05))
    tokens, verified = _run(model, drafter, max_new=24)
    assert verified.startswith("0000" + "1" + "0" * 8 + "1"), verified
    assert tokens == dspark.generate(model, list(range(3, 19)), max_new_tokens=24).token_ids


def test_the_synchronous_planner_still_drafts_every_round(model):
    drafter = LowConfidenceDrafter()
    engine = Engine(model, EngineConfig(max_running=1, draft_tokens="auto", planner="sync", drafter=drafter,
                                        capacity=TABLE))
    engine.add_request(list(range(3, 19)), SamplingParams(), 12)
    rounds = 0
    while engine.has_work():
        engine.step()
        rounds += 1
    assert drafter.proposes == rounds - 1  # every round but the prefill drafts (Algorithm 1 reads them)


class RecordingDrafter(LowConfidenceDrafter):
    """Records every token row it observes, and at each propose how many it had seen and the anchor."""

    def __init__(self):
        super().__init__()
        self.seen, self.calls, self.at_propose = [], 0, []

    def observe(self, dstate, token_ids, hidden, features):
        assert hidden.shape[0] == len(token_ids) and all(f.shape[0] == len(token_ids) for f in features.values())
        self.seen += token_ids.tolist()
        self.calls += 1

    def propose(self, dstates, anchors, params, generators):
        self.at_propose.append((len(self.seen), anchors[0]))
        return super().propose(dstates, anchors, params, generators)


def test_plain_rounds_defer_the_drafters_observe_until_it_drafts(model):
    """Plain rounds' rows reach the drafter in one observe before its next propose (or every 16 rows):
    in order, none missing, fewer observe calls than rounds."""
    drafter = RecordingDrafter()
    tokens, verified = _run(model, drafter, max_new=48)
    sequence = list(range(3, 19)) + tokens
    assert drafter.seen == sequence[:len(drafter.seen)]  # every row once, in order
    assert len(drafter.at_propose) >= 4
    for seen, anchor in drafter.at_propose:  # before drafting, the drafter has seen everything up to the anchor
        assert sequence[seen] == anchor
    assert drafter.calls < 1 + len(verified) - verified.count("0") + verified.count("0") // 8


def test_a_plain_run_plans_again_only_when_its_stale_rows_change(model, monkeypatch):
    """After two plain rounds a request's stale row is the same object round after round, so the plan
    (K = 0) is reused instead of recomputed (`dspark.round._planned_plain`); the rounds are the same."""
    calls = []
    async_budget = dspark.round.async_budget

    def counting(*args, **kwargs):
        calls.append(kwargs.get("min_budget", 0))
        return async_budget(*args, **kwargs)

    monkeypatch.setattr(dspark.round, "async_budget", counting)
    tokens, verified = _run(model, LowConfidenceDrafter())
    reused = len(calls)
    calls.clear()
    monkeypatch.setattr(dspark.round, "_planned_plain", lambda live, stale: False)
    assert _run(model, LowConfidenceDrafter()) == (tokens, verified)
    assert len(calls) == len(verified) + verified.count("01")  # a probe plans twice: plain, then min_budget=1
    drafting = len(verified) - verified.count("0")
    # per drafting round: its own plan, the next two plain rounds' (their stale rows are new), a probe's
    assert reused <= 4 * drafting, (reused, verified)
    assert reused < len(verified) / 2


def test_a_plain_plan_is_reused_only_for_the_same_requests_and_rows():
    from dspark.request import Request
    from dspark.round import _planned_plain

    rows = [torch.rand(GAMMA), torch.rand(GAMMA)]
    a, b, c = (Request([1], None, torch.Generator(), 8, frozenset()) for _ in range(3))
    a.plain_plan = b.plain_plan = tuple(rows)
    assert _planned_plain([a, b], rows)
    assert not _planned_plain([a, b], [rows[0], rows[1].clone()])  # a new stale row: plan again
    assert not _planned_plain([a], rows[:1])  # b left: R changed
    assert not _planned_plain([a, c], rows)  # c joined in b's place
    c.plain_plan = tuple(rows)  # equal, but not the plan a and b share
    assert not _planned_plain([a, c], rows)
    a.preempt()
    assert a.plain_plan is None
