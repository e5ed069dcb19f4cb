"""`train_draft` on the tiny V4 target: it lowers the loss, is deterministic, and the drafter it
trains plugs into speculative decoding with the convention it was trained with.

(b) A drafter trained for a few hundred CPU steps on the target's own greedy continuations keeps
greedy speculative output identical to plain decoding at every budget, and its acceptance is far
above a random drafter's: on the training prompts (the drafter has seen these continuations, so a
train/inference convention mismatch — positions, context, slots — would show as acceptance near
the random one) and, at T = 1, on held-out prompts.
"""

import dataclasses
import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.cli import main as cli_main
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.engine import Engine, EngineConfig
from dspark.tokenizer import ByteTokenizer
from dspark.train.anchors import build_blocks, sample_anchors
from dspark.train.calibrate import StsRecorder, record_rounds
from dspark.train.data import TrainingSequence, read_jsonl, self_distill, write_jsonl
from dspark.train.losses import LossWeights
from dspark.train.trainer import TrainConfig, block_losses, new_training_drafter, train_draft
from dspark.verify.sts import confidence_nll, fit_sts

GAMMA = 5
NEW = 14
SETTINGS = [(n, "sync") for n in range(1, GAMMA + 1)] + [("auto", "sync"), ("auto", "async")]


def _config(**overrides):
    return dict(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()), **overrides)


def _prompts(n, seed, length=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return dspark.init_model(_config(), seed=0)


@pytest.fixture(scope="module")
def dspark_config(tiny):
    return DSparkConfig.for_target(tiny.config, dspark_markov_rank=32)


@pytest.fixture(scope="module")
def train_prompts():
    return _prompts(50, seed=1)


@pytest.fixture(scope="module")
def trained(tiny, dspark_config, train_prompts):
    data = self_distill(tiny, train_prompts, max_new_tokens=32)
    config = TrainConfig(steps=200, num_anchors=16, lr=5e-3, seed=0, progress=False)
    return train_draft(tiny, data, config, dspark_config=dspark_config)


def _fixed_loss(drafter, data, seed=5):
    """Loss of a fixed set of blocks (same anchors for every drafter), without gradients."""
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for seq in data:
            ids, mask = torch.tensor(seq.input_ids), torch.tensor(seq.loss_mask)
            blocks = build_blocks(ids, mask, sample_anchors(mask, 8, g), GAMMA, drafter.config.dspark_noise_token_id)
            loss, _ = block_losses(drafter, ids, blocks, LossWeights(), float(blocks.weights.sum()))
            total += float(loss.detach())
    return total / len(data)


def _tau(outs):
    return sum(o.stats.new_tokens - 1 for o in outs) / sum(o.stats.rounds for o in outs)


# -------------------------------------------------------------------------------------------------
# (f) the training loop
# -------------------------------------------------------------------------------------------------


def test_training_lowers_the_loss_and_is_deterministic(tiny, dspark_config):
    data = self_distill(tiny, _prompts(6, seed=2), max_new_tokens=16)
    config = TrainConfig(steps=20, num_anchors=8, lr=3e-3, seed=7, progress=False, batch_size=2)
    before = _fixed_loss(new_training_drafter(tiny, dspark_config, seed=7), data)  # what training starts from
    a = train_draft(tiny, data, config, dspark_config=dspark_config)
    after = _fixed_loss(a.drafter, data)
    print(f"fixed-block loss {before:.3f} -> {after:.3f}")
    assert after < before - 0.2
    assert len(a.history) == 20 and all(h["grad_norm"] > 0 for h in a.history)
    b = train_draft(tiny, data, config, dspark_config=dspark_config)
    wa, wb = a.drafter.model.state_dict(), b.drafter.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]


def test_data_records_round_trip(tmp_path):
    seqs = [TrainingSequence((1, 2, 3), (0, 1, 1)), TrainingSequence((4, 5), (1, 1))]
    write_jsonl(seqs, tmp_path / "a.jsonl")
    assert read_jsonl(tmp_path / "a.jsonl") == seqs
    (tmp_path / "b.jsonl").write_text('{"prompt": [7, 8], "completion": [9]}\n{"text": "hi"}\n')
    got = read_jsonl(tmp_path / "b.jsonl", ByteTokenizer())
    assert got == [TrainingSequence((7, 8, 9), (0, 0, 1)), TrainingSequence((104, 105), (1, 1))]
    with pytest.raises(ValueError, match="b.jsonl:2"):
        read_jsonl(tmp_path / "b.jsonl")  # text without a tokenizer
    with pytest.raises(ValueError, match="vocabulary"):
        read_jsonl(tmp_path / "a.jsonl", vocab_size=4)


# -------------------------------------------------------------------------------------------------
# (b) a trained drafter in speculative decoding
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny, train_prompts):
    return [o.token_ids for o in dspark.generate(tiny, train_prompts, max_new_tokens=NEW)]


@pytest.mark.parametrize("draft_tokens, planner", SETTINGS)
def test_trained_drafter_is_exact_and_accepts_far_more_than_random(tiny, trained, train_prompts, plain,
                                                                    draft_tokens, planner):
    outs = dspark.generate(tiny, train_prompts, max_new_tokens=NEW, draft_tokens=draft_tokens, planner=planner,
                           drafter=trained.drafter)
    assert [o.token_ids for o in outs] == plain
    verified = sum(o.stats.verified_tokens for o in outs)
    accepted = verified - sum(o.stats.rejected_tokens for o in outs)
    print(f"trained draft_tokens={draft_tokens} {planner}: tau {_tau(outs):.3f}, "
          f"{accepted}/{verified} drafts accepted")
    assert accepted / verified > 0.05  # a random drafter accepts < 1 % on this target


def test_trained_beats_random_at_temperature_one_on_held_out_prompts(tiny, trained, dspark_config):
    prompts = _prompts(50, seed=3)
    random = DSparkDrafter(tiny, dspark_config).init_weights(0)
    taus = {}
    for name, drafter in (("random", random), ("trained", trained.drafter)):
        outs = dspark.generate(tiny, prompts, max_new_tokens=NEW, temperature=1.0, seed=0, draft_tokens=GAMMA,
                               drafter=drafter)
        taus[name] = _tau(outs)
    print(f"held-out, T=1, verify all: tau random {taus['random']:.3f}, trained {taus['trained']:.3f}")
    assert taus["trained"] > taus["random"] + 0.2


# -------------------------------------------------------------------------------------------------
# STS calibration and the command line
# -------------------------------------------------------------------------------------------------


def test_recorder_labels_equal_the_engine_trace(tiny, trained):
    recorder = StsRecorder(trained.drafter, max_new_tokens=12)
    engine = Engine(tiny, EngineConfig(draft_tokens=GAMMA, drafter=recorder, trace=True))
    for i, prompt in enumerate(_prompts(6, seed=4)):
        engine.add_request(prompt, dspark.SamplingParams(temperature=1.0, seed=i), max_new_tokens=12)
    while engine.has_work():
        engine.step()
    full = [t for t in engine.take_trace() if t["verified"] == GAMMA]
    logits, accepted = recorder.data()
    assert accepted.tolist() == [t["accepted"] for t in full]  # every full verify-all round, in order
    torch.testing.assert_close(torch.sigmoid(logits), torch.tensor([t["confidence"] for t in full]))


def test_sts_fit_on_recorded_rounds_improves_the_likelihood(tiny, trained):
    logits, accepted = record_rounds(tiny, trained.drafter, _prompts(12, seed=6), max_new_tokens=20, temperature=1.0)
    assert logits.shape == (len(accepted), GAMMA) and len(accepted) > 20
    cal = fit_sts(logits, accepted)
    # Each T_k minimises its position's conditional BCE over a range containing 1, so the total NLL
    # of the observed accepted counts cannot get worse than the raw head's.
    assert confidence_nll(logits, accepted, cal.temperatures) <= confidence_nll(logits, accepted, (1.0,) * GAMMA)
    print(f"STS on {cal.num_samples} rounds: T = {[round(t, 2) for t in cal.temperatures]}, "
          f"NLL {confidence_nll(logits, accepted, (1.0,) * GAMMA):.3f} -> "
          f"{confidence_nll(logits, accepted, cal.temperatures):.3f}")


def test_cli_trains_and_calibrates_a_drafter_directory(tmp_path):
    data = [TrainingSequence(tuple(range(i, i + 12)), (0, 0) + (1,) * 10) for i in range(3)]
    write_jsonl(data, tmp_path / "train.jsonl")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(4, 7)))
    out = tmp_path / "drafter"
    assert cli_main(["train-draft", "--data", str(tmp_path / "train.jsonl"), "--out", str(out), "--steps", "3",
                     "--num-anchors", "4", "--markov-rank", "8", "--block-size", "3", "--device", "cpu"]) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "history.jsonl"}
    assert cli_main(["calibrate-draft", "--drafter", str(out), "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--max-new-tokens", "12", "--device", "cpu"]) == 0
    target = dspark.init_model(_config(), seed=0)
    drafter = dspark.load_drafter(out, target)
    assert drafter.block_size == 3 and drafter.calibration is not None and drafter.calibration.gamma == 3


def test_micro_batched_step_equals_per_sequence_losses(tiny, dspark_config):
    """Several sequences in one target call and one drafter call (`concat_blocks`) give the loss and
    gradients of one call per sequence: each block's context stays inside its own sequence."""
    drafter = new_training_drafter(tiny, dspark_config, seed=3)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (40, 23, 57)]
    # Anchors near each sequence's start: a context window leaking into the previous sequence
    # would change their loss.
    groups = [build_blocks(ids, torch.ones_like(ids), torch.tensor([0, 2, 9, n - 3]), GAMMA,
                           dspark_config.dspark_noise_token_id) for ids, n in zip(seqs, (40, 23, 57))]
    norm = float(sum(b.weights.sum() for b in groups))

    def loss_and_grads(split):
        drafter.model.zero_grad(set_to_none=True)
        drafter.model.requires_grad_(True)
        total = 0.0
        if split:
            for ids, blocks in zip(seqs, groups):
                loss, _ = block_losses(drafter, ids, blocks, LossWeights(), norm)
                loss.backward()
                total += float(loss.detach())
        else:
            loss, _ = block_losses(drafter, seqs, groups, LossWeights(), norm)
            loss.backward()
            total = float(loss.detach())
        return total, {n: p.grad.clone() for n, p in drafter.model.named_parameters() if p.grad is not None}

    loss_one, grads_one = loss_and_grads(split=True)
    loss_all, grads_all = loss_and_grads(split=False)
    assert loss_all == pytest.approx(loss_one, rel=1e-5)
    assert grads_one.keys() == grads_all.keys() and grads_one
    for name in grads_one:
        torch.testing.assert_close(grads_all[name], grads_one[name], atol=1e-5, rtol=1e-4, msg=name)


def test_cached_target_trains_the_same_drafter(tiny, dspark_config):
    """With the target's rows kept after their first pass, training gives the same drafter as
    recomputing them every step, and the target runs once per sequence."""
    data = self_distill(tiny, _prompts(6, seed=7), max_new_tokens=12)
    # One sequence per target call: a recomputed row is then bit-identical to the kept one.
    config = TrainConfig(steps=6, batch_size=2, num_anchors=6, lr=3e-3, seed=1, progress=False)
    calls = []
    forward = tiny.forward

    def counting(input_ids, states, *args, **kwargs):
        calls.append(len(states))
        return forward(input_ids, states, *args, **kwargs)

    plain = train_draft(tiny, data, config, dspark_config=dspark_config).drafter.model.state_dict()
    tiny.forward = counting
    try:
        cached = train_draft(tiny, data, dataclasses.replace(config, cache_target=True),
                             dspark_config=dspark_config).drafter.model.state_dict()
    finally:
        del tiny.forward
    assert sum(calls) == len(data)  # 6 steps × 2 sequences = 2 epochs: the second one is all cached
    for name, value in plain.items():
        assert torch.equal(cached[name], value), name
