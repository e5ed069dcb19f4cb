"""dspark.sampling: parameter validation, the target distribution, and sync-free sampling."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.sampling import (SamplingParams, greedy, probs_from_logits, sample, sample_from_logits)


# ---------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "1.0"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": True}, "seed"),
])
def test_sampling_params_rejects_bad_values_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_normalisation_and_frozen():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.0, 1.0, 0, None) and p.greedy
    q = SamplingParams(temperature=1, top_p=1, top_k=np.int64(5), seed=np.int64(3))
    assert type(q.temperature) is float and type(q.top_k) is int and type(q.seed) is int
    assert q == SamplingParams(1.0, 1.0, 5, 3) and hash(q) == hash(SamplingParams(1.0, 1.0, 5, 3))
    assert not q.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.temperature = 2.0


def test_make_generator_is_seeded_and_private():
    p = SamplingParams(temperature=1.0, seed=1234)
    a = torch.rand(5, generator=p.make_generator())
    b = torch.rand(5, generator=p.make_generator())
    assert torch.equal(a, b)
    c = torch.rand(5, generator=SamplingParams(temperature=1.0, seed=1235).make_generator())
    assert not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------
# probs_from_logits


def test_temperature_one_is_softmax_and_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 3.0, -2.0]])
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(1.0)), torch.softmax(logits, -1))
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(0.5)), torch.softmax(2 * logits, -1))


def test_greedy_is_one_hot_argmax_with_ties_to_lowest_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    probs = probs_from_logits(logits, SamplingParams(0.0, top_k=3, top_p=0.5))
    expected = torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]])
    assert probs.dtype == torch.float32 and torch.equal(probs, expected)
    assert greedy(logits).tolist() == [1, 0, 2]
    assert greedy(logits).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("shape", [(1, 129280), (3, 129280), (2, 2, 65536), (4, 40000), (2, 129281), (65, 32768)])
def test_greedy_on_long_rows_is_torch_argmax(shape, monkeypatch):
    """Long rows take the two-pass path (first maximum per chunk, then the first chunk with the row
    maximum); it must pick torch.argmax's index: ties (many, from small integers) to the lowest id,
    a row of one value, -inf rows and NaN as the maximum. 129281 divides by no chunk count and 65 rows
    are more than TWO_PASS_MAX_ROWS: one pass."""
    import dspark.sampling as sampling

    passes = []
    real_max = torch.Tensor.max
    monkeypatch.setattr(torch.Tensor, "max", lambda self, *a, **k: passes.append(a) or real_max(self, *a, **k))
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randint(-4, 5, shape, generator=g).float()
    rows = x.view(-1, shape[-1])
    rows[0] = 1.0  # one value everywhere: index 0
    if rows.shape[0] > 2:
        rows[1] = float("-inf")
        rows[2, shape[-1] - 1] = float("nan")
    assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert torch.equal(greedy(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    rows = x.numel() // shape[-1]
    assert bool(passes) == (any(shape[-1] % c == 0 for c in sampling._TWO_PASS_CHUNKS) and rows <= sampling.TWO_PASS_MAX_ROWS)
    y = torch.randn(shape, generator=g)
    assert torch.equal(greedy(y), y.argmax(dim=-1))


def test_top_k_keeps_ties_at_the_kth_value():
    # logits [2, 1, 1, 0], top_k = 2: the 2nd largest value (1) is tied, so both 1s stay.
    probs = probs_from_logits(torch.tensor([2.0, 1.0, 1.0, 0.0]), SamplingParams(1.0, top_k=2))
    e = math.e
    expected = torch.tensor([e * e, e, e, 0.0]) / (e * e + 2 * e)
    torch.testing.assert_close(probs, expected)
    one = probs_from_logits(torch.tensor([0.1, 2.0, -3.0]), SamplingParams(1.0, top_k=1))
    assert torch.equal(one, torch.tensor([0.0, 1.0, 0.0]))
    full = probs_from_logits(torch.tensor([0.1, 2.0, -3.0]), SamplingParams(1.0, top_k=3))
    torch.testing.assert_close(full, torch.softmax(torch.tensor([0.1, 2.0, -3.0]), -1))


@pytest.mark.parametrize("top_p, kept", [(0.49, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.96, 4)])
def test_top_p_keeps_the_token_that_crosses_p(top_p, kept):
    # p = [0.5, 0.3, 0.15, 0.05]: cumulative 0.5, 0.8, 0.95, 1.0; the crossing token is kept.
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = probs_from_logits(base.log(), SamplingParams(1.0, top_p=top_p))
    expected = torch.where(torch.arange(4) < kept, base, torch.zeros(4))
    torch.testing.assert_close(probs, expected / expected.sum())


def test_top_p_keeps_ties_with_the_crossing_token():
    # p = [0.4, 0.3, 0.3], top_p = 0.5: a 0.3 crosses; the other 0.3 is tied with it and stays.
    base = torch.tensor([0.4, 0.3, 0.3])
    torch.testing.assert_close(probs_from_logits(base.log(), SamplingParams(1.0, top_p=0.5)), base)
    # Permuting the vocabulary permutes the result: the kept set does not depend on sort order.
    perm = torch.tensor([2, 0, 1])
    torch.testing.assert_close(probs_from_logits(base.log()[perm], SamplingParams(1.0, top_p=0.5)), base[perm])


def test_temperature_is_applied_before_top_p():
    # T = 1: p = [0.6, 0.3, 0.1] -> top_p 0.7 keeps 2 tokens. T = 0.5: p ∝ [0.36, 0.09, 0.01]
    # = [0.783, 0.196, 0.022] -> the first token alone crosses 0.7.
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    at_one = probs_from_logits(logits, SamplingParams(1.0, top_p=0.7))
    torch.testing.assert_close(at_one, torch.tensor([2 / 3, 1 / 3, 0.0]))
    at_half = probs_from_logits(logits, SamplingParams(0.5, top_p=0.7))
    assert torch.equal(at_half, torch.tensor([1.0, 0.0, 0.0]))


def test_top_p_measures_mass_inside_the_top_k_renormalised_distribution():
    # p = [0.4, 0.3, 0.2, 0.1], top_k 2 -> [4/7, 3/7]; top_p 0.5 is crossed by 4/7 alone.
    # (Measured against the original mass, 0.4 < 0.5 would have kept both.)
    probs = probs_from_logits(torch.tensor([0.4, 0.3, 0.2, 0.1]).log(), SamplingParams(1.0, top_k=2, top_p=0.5))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    both = probs_from_logits(torch.tensor([0.4, 0.3, 0.2, 0.1]).log(), SamplingParams(1.0, top_k=2, top_p=0.6))
    torch.testing.assert_close(both, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_probs_shapes_dtypes_masks_and_tiny_temperature():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)).bfloat16()
    probs = probs_from_logits(logits, SamplingParams(0.8, top_k=4, top_p=0.9))
    assert probs.shape == (2, 3, 7) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert ((probs > 0).sum(-1) <= 4).all()
    masked = probs_from_logits(torch.tensor([0.0, -math.inf, 1.0]), SamplingParams(1.0))
    assert masked[1] == 0 and torch.isfinite(masked).all()
    tiny = probs_from_logits(torch.tensor([1.0, 3.0, 2.0]), SamplingParams(1e-30))
    assert torch.equal(tiny, torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="logits"):
        probs_from_logits(torch.tensor([1, 2, 3]), SamplingParams(1.0))


# ---------------------------------------------------------------------------------------------
# sample


def test_sample_frequencies_match_probs_chi_square():
    probs = torch.tensor([0.02, 0.08, 0.1, 0.3, 0.0, 0.25, 0.05, 0.2])
    n = 200_000
    gen = torch.Generator().manual_seed(7)
    draws = sample(probs.expand(n, -1), gen)
    assert draws.shape == (n,) and draws.dtype == torch.int64
    counts = torch.bincount(draws, minlength=8).double().numpy()
    assert counts[4] == 0  # a zero-probability token is never drawn
    support = probs.numpy() > 0
    _, pvalue = chisquare(counts[support], n * probs.double().numpy()[support])
    assert pvalue > 1e-3


def test_sample_accepts_unnormalised_weights():
    weights = torch.tensor([3.0, 1.0, 0.0, 4.0])  # ∝ [0.375, 0.125, 0, 0.5]
    n = 100_000
    counts = torch.bincount(sample(weights.expand(n, -1), torch.Generator().manual_seed(1)), minlength=4)
    assert counts[2] == 0
    _, pvalue = chisquare(counts[[0, 1, 3]].double().numpy(), n * np.array([0.375, 0.125, 0.5]))
    assert pvalue > 1e-3


def test_sample_uses_only_the_explicit_generator():
    probs = torch.softmax(torch.randn(64, 10, generator=torch.Generator().manual_seed(0)), -1)
    state = torch.get_rng_state()
    a = sample(probs, torch.Generator().manual_seed(5))
    b = sample(probs, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not touched


def test_sample_with_per_row_generators_matches_row_by_row_calls():
    probs = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(3)), -1)
    batched = sample(probs, [torch.Generator().manual_seed(100 + r) for r in range(4)])
    single = [int(sample(probs[r], torch.Generator().manual_seed(100 + r))) for r in range(4)]
    assert batched.tolist() == single
    with pytest.raises(ValueError, match="generator"):
        sample(probs, [torch.Generator()] * 3)


def test_sample_from_logits_greedy_draws_nothing():
    logits = torch.tensor([[0.0, 2.0, 1.0], [4.0, 4.0, 0.0]])
    gen = torch.Generator().manual_seed(9)
    state = gen.get_state()
    assert sample_from_logits(logits, SamplingParams(0.0), gen).tolist() == [1, 0]
    assert torch.equal(gen.get_state(), state)
    untied = torch.tensor([[0.0, 2.0, 1.0], [4.0, 3.0, 0.0]])
    assert sample_from_logits(untied, SamplingParams(1.0, top_k=1), gen).tolist() == [1, 0]
    assert not torch.equal(gen.get_state(), state)  # sampled path: the generator advanced


def test_tiny_temperature_is_refused_and_tiny_top_p_keeps_the_argmax():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-40)
    logits = torch.tensor([[0.3, 2.0, -1.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-40))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]
