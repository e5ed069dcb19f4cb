"""Speculative decoding with the DSpark and MTP drafters is exact on the tiny V4 target.

(a) Greedy output with a randomly initialised DSpark drafter, and with MTP-1 / a chained MTP, equals
plain decoding for 50 prompts at every fixed budget 1..γ and with the confidence planner (sync and
async). (c) At T = 1, sampled output with DSpark proposals — real draft distributions q from the
Markov chain, so rejection sampling runs its residual path — follows the target's distribution
(χ² against exact enumeration on a 4-token vocabulary).
"""


import pytest
import torch
from scipy.stats import chisquare

import dspark
from draft_targets import tiny_v4_config
from dspark.draft import DSparkConfig, DSparkDrafter, MtpDrafter

GAMMA = 5
NEW = 14
SETTINGS = [(n, "sync") for n in range(1, GAMMA + 1)] + [("auto", "sync"), ("auto", "async")]


@pytest.fixture(scope="module")
def plain(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(50)]
    return prompts, [o.token_ids for o in dspark.generate(tiny, prompts, max_new_tokens=NEW)]


@pytest.fixture(scope="module")
def drafters(tiny):
    return {
        "dspark": DSparkDrafter(tiny, DSparkConfig.for_target(tiny.config, dspark_markov_rank=32)).init_weights(11),
        "mtp1": MtpDrafter(tiny),
        "mtp-chain": MtpDrafter(tiny, block_size=3),
    }


CASES = ([("dspark", n, p) for n, p in SETTINGS] + [("mtp1", n, p) for n, p in SETTINGS if n in (1, "auto")]
         + [("mtp-chain", 3, "sync")])


@pytest.mark.parametrize("name, draft_tokens, planner", CASES)
def test_greedy_speculative_equals_plain(tiny, plain, drafters, name, draft_tokens, planner):
    prompts, reference = plain
    outs = dspark.generate(tiny, prompts, max_new_tokens=NEW, draft_tokens=draft_tokens, planner=planner,
                           drafter=drafters[name])
    assert [o.token_ids for o in outs] == reference
    verified = sum(o.stats.verified_tokens for o in outs)
    rounds = sum(o.stats.rounds for o in outs)
    assert verified > 0
    print(f"{name} draft_tokens={draft_tokens} {planner}: {rounds} rounds, {verified} verified, "
          f"{verified - sum(o.stats.rejected_tokens for o in outs)} accepted, "
          f"tau {sum(len(r) - 1 for r in reference) / rounds:.3f}")


def test_default_drafter_of_a_model_with_mtp_is_mtp(tiny, plain):
    prompts, reference = plain
    outs = dspark.generate(tiny, prompts[:5], max_new_tokens=NEW, draft_tokens=1)
    assert [o.token_ids for o in outs] == reference[:5]
    assert all(len(o.stats.accept_hist) == 2 for o in outs)  # γ = 1: MTP-1 was picked


def test_sampled_dspark_matches_target_distribution(exact_pair_distribution):
    vocab = 4
    model = dspark.init_model(tiny_v4_config(vocab_size=vocab, bos_token_id=None, eos_token_id=None), seed=1)
    drafter = DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=4)).init_weights(2)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = dspark.SamplingParams(temperature=1.0)
    with torch.no_grad():
        exact = exact_pair_distribution(model, prompt, vocab, params).flatten()
    n = 1000
    outs = dspark.generate(model, [prompt] * n, max_new_tokens=4, temperature=1.0, seed=11, draft_tokens=GAMMA,
                           drafter=drafter)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1] * vocab + o.token_ids[2]] += 1
    accepted = sum(o.stats.verified_tokens - o.stats.rejected_tokens for o in outs)
    assert accepted > 0 and sum(o.stats.rejected_tokens for o in outs) > 0  # both paths ran
    keep = exact > 0
    assert counts[~keep].sum() == 0
    p = chisquare(counts[keep].numpy(), (exact[keep] / exact[keep].sum() * n).numpy()).pvalue
    print(f"DSpark proposals at T=1: chi-square p = {p:.3f}, {accepted} drafts accepted")
    assert p > 1e-3
