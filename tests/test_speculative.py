"""Speculative `generate` is exact: greedy output is token-identical to plain decoding, and sampled
output follows the target's distribution (χ² against exact enumeration)."""

import json
from importlib import resources

import pytest
import torch
from scipy.stats import chisquare

import dspark
from dspark.draft.ngram import NgramDrafter

GAMMA = 5


def _config(**overrides):
    return dict(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()), **overrides)


@pytest.fixture(scope="module")
def tiny():
    return dspark.init_model(_config(), seed=0)


def _repetitive_prompts(n, seed=0):
    """Prompts made of a repeated random motif, so n-gram drafts are often (not always) right."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        motif = torch.randint(0, 256, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        reps = int(torch.randint(2, 5, (1,), generator=g))
        tail = torch.randint(0, 256, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist()
        prompts.append(motif * reps + tail)
    return prompts


@pytest.fixture(scope="module")
def plain(tiny):
    prompts = _repetitive_prompts(50)
    return prompts, [o.token_ids for o in dspark.generate(tiny, prompts, max_new_tokens=24)]


@pytest.mark.parametrize("draft_tokens, planner", [(n, "sync") for n in range(1, GAMMA + 1)]
                         + [("auto", "sync"), ("auto", "async")])
def test_greedy_speculative_equals_plain(tiny, plain, draft_tokens, planner):
    prompts, reference = plain
    outs = dspark.generate(tiny, prompts, max_new_tokens=24, draft_tokens=draft_tokens, planner=planner,
                           drafter=NgramDrafter(block_size=GAMMA))
    assert [o.token_ids for o in outs] == reference
    accepted = sum(sum(k * c for k, c in enumerate(o.stats.accept_hist)) for o in outs)
    rejected = sum(o.stats.rejected_tokens for o in outs)
    rounds = sum(o.stats.rounds for o in outs)
    # Every path must have run: accepted drafts, rejected drafts, and rounds that committed > 1 token.
    assert accepted > 0 and rejected > 0
    assert rounds < sum(len(r) - 1 for r in reference)
    print(f"draft_tokens={draft_tokens} planner={planner}: {rounds} rounds, {accepted} accepted, "
          f"{rejected} rejected, tau {sum(len(r) - 1 for r in reference) / rounds:.2f}")


def test_stats_are_consistent(tiny):
    out = dspark.generate(tiny, _repetitive_prompts(1, seed=5)[0], max_new_tokens=20, draft_tokens=3,
                          drafter="ngram")
    s = out.stats
    assert sum(s.accept_hist) == s.rounds
    assert s.verified_tokens - s.rejected_tokens == sum(k * c for k, c in enumerate(s.accept_hist))
    assert s.position_accepts == sorted(s.position_accepts, reverse=True)
    assert s.new_tokens == len(out.token_ids) == 20
    assert s.tau == pytest.approx((s.new_tokens - 1) / s.rounds)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_speculative_matches_target_distribution(temperature, top_p, exact_pair_distribution):
    vocab = 4
    model = dspark.init_model(_config(vocab_size=vocab, bos_token_id=None, eos_token_id=None), seed=1)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = dspark.SamplingParams(temperature=temperature, top_p=top_p)
    exact = exact_pair_distribution(model, prompt, vocab, params).flatten()
    n = 1500
    outs = dspark.generate(model, [prompt] * n, max_new_tokens=4, temperature=temperature, top_p=top_p,
                           seed=11, draft_tokens=GAMMA, drafter=NgramDrafter(block_size=GAMMA))
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1] * vocab + o.token_ids[2]] += 1
    # Both the accept and the reject path ran (n-gram drafts on a repetitive prompt).
    assert sum(sum(k * c for k, c in enumerate(o.stats.accept_hist)) for o in outs) > 0
    assert sum(o.stats.rejected_tokens for o in outs) > 0
    keep = exact > 0
    assert counts[~keep].sum() == 0
    p = chisquare(counts[keep].numpy(), (exact[keep] / exact[keep].sum() * n).numpy()).pvalue
    print(f"T={temperature} top_p={top_p}: chi-square p = {p:.3f}")
    assert p > 1e-3


def test_bad_drafter_names_are_refused(tiny):
    with pytest.raises(ValueError, match="nonsense"):
        dspark.generate(tiny, [1, 2, 3], draft_tokens=2, drafter="nonsense")
    with pytest.raises(ValueError, match="lacks"):
        dspark.generate(tiny, [1, 2, 3], draft_tokens=2, drafter=object())


def test_rounds_verify_in_batched_calls(tiny, monkeypatch):
    """A round's greedy requests are verified from one argmax over every row and one host copy; its
    sampled requests in one `verify_chain_batch` per group of equal parameters (seed aside) and
    verify length, each row from its request's generator: the same tokens as each request alone."""
    import dspark.round as round_module

    calls = []
    original = round_module.verify_chain_batch

    def counting(drafts, q, logits, lengths, params, generator):
        calls.append((params, drafts.shape[0]))
        return original(drafts, q, logits, lengths, params, generator)

    monkeypatch.setattr(round_module, "verify_chain_batch", counting)
    prompts = _repetitive_prompts(4, seed=5)
    greedy = dspark.generate(tiny, prompts, max_new_tokens=8, draft_tokens=3, drafter=NgramDrafter(GAMMA))
    assert calls == [] and all(len(out.token_ids) >= 1 for out in greedy)
    options = dict(max_new_tokens=12, draft_tokens=3, drafter=NgramDrafter(GAMMA), temperature=1.0, top_k=40)
    batch = dspark.generate(tiny, prompts, seed=3, **options)
    assert calls and all(not p.greedy and p.seed is None for p, _ in calls)
    assert max(rows for _, rows in calls) > 1  # requests shared a verify call
    calls.clear()
    alone = [dspark.generate(tiny, p, seed=3 + i, **options) for i, p in enumerate(prompts)]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert calls and all(rows == 1 for _, rows in calls)
