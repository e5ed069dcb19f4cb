"""`dspark profile --engine`: a capacity table priced by the engine's own rounds."""

import pytest
import torch

import dspark
from dspark.cli import main
from dspark.engine import round_profile
from dspark.engine.round_profile import RoundProfileConfig, profile_rounds, round_seconds
from dspark.verify.capacity import CapacityTable


@pytest.fixture(scope="module")
def tiny():
    return dspark.load_model("tiny")


def test_each_load_and_budget_prices_its_own_tokens(tiny, monkeypatch):
    """B = R(1 + n) per drafting budget (equal B pooled), the plain curve from n = 0, each pair timed by
    an engine at that budget; the engine's steps are what is timed (here 1 ms per request per token)."""
    seen = []

    def fake(model, drafter, requests, budget, config):
        seen.append((requests, budget))
        return [1e-3 * requests * (1 + budget)] * config.steps

    monkeypatch.setattr(round_profile, "round_seconds", fake)
    config = RoundProfileConfig(requests=(1, 2), budgets=(0, 1, 3), context=8, warmup=0, steps=3)
    table = profile_rounds(tiny, tiny.dspark, config, "tiny", "dspark")
    assert seen == [(1, 0), (1, 1), (1, 3), (2, 0), (2, 1), (2, 3)]
    assert table.batch_tokens == (2, 4, 8)  # (1, 1); (1, 3) and (2, 1) pooled; (2, 3)
    assert [round(1 / s * 1e3) for s in table.steps_per_second] == [2, 4, 8]
    assert table.plain_requests == (1, 2) and [round(1 / s * 1e3) for s in table.plain_steps_per_second] == [1, 2]
    assert "engine rounds" in table.label and table.conditions["budgets"] == [0, 1, 3]


def test_a_real_engine_is_timed_at_every_step(tiny):
    torch.manual_seed(0)
    config = RoundProfileConfig(requests=(2,), context=16, warmup=1, steps=4)
    for budget in (0, 2):
        seconds = round_seconds(tiny, tiny.dspark, 2, budget, config)
        assert len(seconds) == 4 and all(0 < s < 10 for s in seconds)


def test_steps_whose_batch_changed_are_dropped(tiny, monkeypatch):
    """A request that ends (EOS) changes the batch: its step is not a round of R requests. With every
    token an EOS the requests end at once and too few steps are left: a clear error, not a table."""
    class EosEverywhere(round_profile.Engine):
        def __init__(self, model, config):
            super().__init__(model, config)
            self.eos = frozenset(range(model.config.vocab_size))

    monkeypatch.setattr(round_profile, "Engine", EosEverywhere)
    with pytest.raises(RuntimeError, match="steps kept"):
        round_seconds(tiny, tiny.dspark, 2, 1, RoundProfileConfig(requests=(2,), context=8, warmup=0, steps=4))


def test_a_sampled_profile_times_sampled_requests(tiny, monkeypatch):
    """temperature > 0: every request the timed engines serve samples at it, each with its own seed,
    and the table says so (label, conditions, method): the table of sampled rounds."""
    params = []

    class Watched(round_profile.Engine):
        def add_request(self, prompt, sampling, max_new, **kwargs):
            params.append(sampling)
            return super().add_request(prompt, sampling, max_new, **kwargs)

    monkeypatch.setattr(round_profile, "Engine", Watched)
    config = RoundProfileConfig(requests=(2,), budgets=(0, 1), context=8, warmup=0, steps=3, temperature=1.0, seed=5)
    table = profile_rounds(tiny, tiny.dspark, config, "tiny", "dspark")
    assert [(p.temperature, p.seed) for p in params] == [(1.0, 5), (1.0, 6)] * 2
    assert table.label.endswith("T=1") and table.conditions["temperature"] == 1.0
    assert "sampled requests" in table.conditions["method"]


@pytest.mark.parametrize("requests, budget", [(1, 1), (1, 3), (2, 2), (4, 5)])
def test_the_forcing_table_holds_auto_at_its_budget(requests, budget):
    """Whatever the (positive) confidences, the asynchronous planner's total is R·n and the round in
    flight's uniform budget n: "auto" rounds at budget n, for `auto_rounds`."""
    from dspark.verify.planner import async_budget, uniform_budget

    gamma, table = 5, round_profile.forcing_table(requests, budget)
    g = torch.Generator().manual_seed(requests * 10 + budget)
    for stale in ([None] * requests, [torch.rand(gamma, generator=g) * 0.98 + 0.01 for _ in range(requests)]):
        assert async_budget(stale, gamma, table) == requests * budget
        assert uniform_budget(stale, gamma, table, min_budget=0) == budget


def test_auto_rounds_time_an_auto_engine_held_at_each_budget(tiny, monkeypatch):
    """The drafting budgets run on "auto" engines whose table is the forcing one (the plain one stays a
    plain engine; the next test shows such an engine verifies R·n drafts a round); the table says how it
    was made."""
    built = []

    class Watched(round_profile.Engine):
        def __init__(self, model, config):
            super().__init__(model, config)
            built.append((config.draft_tokens, config.capacity.label if config.capacity else None))

    monkeypatch.setattr(round_profile, "Engine", Watched)
    config = RoundProfileConfig(requests=(2,), budgets=(0, 2), context=8, warmup=1, steps=4, auto_rounds=True)
    table = profile_rounds(tiny, tiny.dspark, config, "tiny", "dspark")
    assert built == [(0, None), ("auto", "forces K = 4 at R = 2")]
    assert table.label.endswith("auto rounds") and table.conditions["rounds"] == "auto"
    assert table.batch_tokens == (6,) and "held by auto" in table.conditions["method"]


def test_an_auto_engine_held_by_the_forcing_table_verifies_its_budget(tiny):
    from dspark.engine import Engine, EngineConfig
    from dspark.sampling import SamplingParams

    engine = Engine(tiny, EngineConfig(max_running=2, draft_tokens="auto", trace=True,
                                       capacity=round_profile.forcing_table(2, 2)))
    for i in range(2):
        engine.add_request(list(range(3 + i, 19 + i)), SamplingParams(), 30)
    while engine.has_work():
        engine.step()
    trace = engine.take_trace()[:16]  # the first 8 rounds (a record per request each), far from the caps
    assert all(r["load"] == 2 for r in trace)
    # K = R·n = 4 drafts a round, spread over the two requests by their current confidences
    assert [a["verified"] + b["verified"] for a, b in zip(trace[::2], trace[1::2])] == [4] * 8


@pytest.mark.parametrize("bad", [dict(requests=()), dict(requests=(2, 1)), dict(budgets=(0, 0)),
                                 dict(budgets=(-1, 1)), dict(steps=2), dict(context=0), dict(warmup=True),
                                 dict(temperature=-1.0), dict(temperature=float("nan")), dict(auto_rounds="yes")])
def test_config_is_validated(bad):
    with pytest.raises(ValueError):
        RoundProfileConfig(**bad)


def test_budgets_must_fit_the_drafter_and_draft(tiny):
    with pytest.raises(ValueError, match="block size"):
        profile_rounds(tiny, tiny.dspark, RoundProfileConfig(budgets=(0, tiny.dspark.block_size + 1)))
    with pytest.raises(ValueError, match="no drafting budget"):
        profile_rounds(tiny, tiny.dspark, RoundProfileConfig(budgets=(0,)))


def test_cli_writes_a_table_that_generate_reads(tmp_path, capsys):
    out = tmp_path / "rounds.json"
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--engine", "--drafter", "dspark",
                 "--requests", "1", "--budgets", "0,2", "--context", "8", "--warmup", "0", "--steps", "3",
                 "--out", str(out)]) == 0
    table = CapacityTable.load(out)
    assert table.batch_tokens == (3,) and table.plain_requests == (1,)
    assert main(["generate", "ab", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "4",
                 "--draft-tokens", "auto", "--capacity", str(out)]) == 0
    with pytest.raises(SystemExit, match="--drafter"):
        main(["profile", "--model", "tiny", "--device", "cpu", "--engine", "--context", "8", "--out", str(out)])
    with pytest.raises(SystemExit, match="--temperature 1 needs --engine"):
        main(["profile", "--model", "tiny", "--device", "cpu", "--temperature", "1", "--out", str(out)])
    with pytest.raises(SystemExit, match="--auto-rounds needs --engine"):
        main(["profile", "--model", "tiny", "--device", "cpu", "--auto-rounds", "--out", str(out)])


@pytest.mark.gpu
def test_on_cuda_the_rounds_timed_are_the_graph_rounds_in_flight(monkeypatch):
    """On CUDA every engine the profile builds runs the static path (graphs) and, drafting, keeps its
    round in flight: the table prices what "auto" there chooses between."""
    model = dspark.load_model("tiny", device="cuda")
    built = []

    class Watched(round_profile.Engine):
        def __init__(self, model, config):
            super().__init__(model, config)
            built.append((config.draft_tokens, self.static, self.draft_ahead is not None, self.lookahead is not None))

    monkeypatch.setattr(round_profile, "Engine", Watched)
    table = profile_rounds(model, model.dspark, RoundProfileConfig(requests=(1, 2), budgets=(0, 2), context=32,
                                                                   warmup=2, steps=6))
    assert built == [(0, True, False, True), (2, True, True, False)] * 2
    assert table.batch_tokens == (3, 6) and table.plain_requests == (1, 2)
