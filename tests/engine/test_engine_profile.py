"""`dspark profile`: a labelled SPS(B) table on the current device, read back by `--capacity`."""

import json

import pytest
import torch

import dspark
from dspark.cli import main
from dspark.profile import ProfileConfig, build_states, split_tokens, time_step
from dspark.verify.capacity import CapacityTable


def test_profile_writes_a_labelled_table_that_generate_reads(tmp_path, capsys):
    out = tmp_path / "sps.json"
    assert main(["profile", "--model", "random-tiny", "--device", "cpu", "--batch-tokens", "1,3,8",
                 "--context", "24", "--width", "3", "--warmup", "0", "--repeats", "2", "--out", str(out)]) == 0
    table = CapacityTable.load(out)
    assert table.batch_tokens == (1, 3, 8) and all(s > 0 for s in table.steps_per_second)
    # plain steps of R requests, one token each, up to the ceil(8 / 3) = 3 states the probes built
    assert table.plain_requests == (1, 3) and all(s > 0 for s in table.plain_steps_per_second)
    assert torch.__version__ in table.label and "cpu" in table.label and "ctx 24" in table.label
    c = json.loads(out.read_text())["conditions"]
    assert c["model"] == "random-tiny" and c["context"] == 24 and c["width"] == 3 and c["date"][:2] == "20"
    assert c["model_config"]["hidden_size"] == 64 and c["torch"] == torch.__version__
    capsys.readouterr()
    assert main(["generate", "ab", "--model", "random-tiny", "--device", "cpu", "--max-new-tokens", "4",
                 "--draft-tokens", "auto", "--drafter", "ngram", "--capacity", str(out)]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "ab", "--model", "random-tiny", "--device", "cpu", "--capacity", str(tmp_path / "none.json")])
    assert main(["profile", "--model", "random-tiny", "--device", "cpu", "--batch-tokens", "1,2", "--context", "8",
                 "--warmup", "0", "--repeats", "1", "--no-plain", "--out", str(out)]) == 0
    assert CapacityTable.load(out).plain_requests == ()


def test_probes_rewind_every_state_to_the_context():
    model = dspark.load_model("random-tiny")
    with torch.inference_mode():
        states = build_states(model, 3, 10, chunk=4)
        assert [s.length for s in states] == [10, 10, 10]
        before = [s.snapshot(live_only=True) for s in states]
        time_step(model, states, split_tokens(7, 3), torch.Generator().manual_seed(0))
    assert split_tokens(7, 3) == [3, 3, 1] and split_tokens(6, 3) == [3, 3]
    for state, snap in zip(states, before):
        after = state.snapshot(live_only=True)
        assert after["length"] == 10 and torch.equal(after["tokens"], snap["tokens"])


@pytest.mark.parametrize("bad", [dict(batch_tokens=(4, 2)), dict(batch_tokens=()), dict(context=0),
                                 dict(width=0), dict(repeats=0), dict(plain=1)])
def test_profile_config_is_validated(bad):
    with pytest.raises(ValueError):
        ProfileConfig(**bad)


def test_a_drafter_prices_its_propose_into_every_width_probe(monkeypatch):
    """With a drafter, each width probe adds the median propose time of its ceil(B / width) requests
    (timed here as 1 s per request, so the target's own milliseconds hardly matter), the plain curve
    stays drafter-free, and the drafter's states hold the probes' context."""
    from dspark import profile

    model = dspark.load_model("tiny")
    seen = []

    def fake_propose(drafter, dstates, vocab, generator, device):
        seen.append([s.length for s in dstates])
        return float(len(dstates))

    monkeypatch.setattr(profile, "time_propose", fake_propose)
    config = ProfileConfig(batch_tokens=(2, 6, 12), context=16, width=6, warmup=0, repeats=1)
    table = profile.profile_capacity(model, config, "tiny", drafter=model.dspark, drafter_name="dspark")
    assert [round(1 / s) for s in table.steps_per_second] == [1, 1, 2]  # 1 s + ms, 1 s + ms, 2 s + ms
    assert all(s > 2 for s in table.plain_steps_per_second)
    assert sorted(map(len, seen)) == [1, 2] and all(length == 16 for lengths in seen for length in lengths)
    assert "drafting rounds (dspark)" in table.label and "propose" in table.conditions["draft_method"]
