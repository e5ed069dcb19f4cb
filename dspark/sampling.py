"""Sampling parameters, the target distribution they define, and sync-free sampling.

The request's `SamplingParams` define the *target* distribution p_t that speculative decoding must
reproduce exactly (spec §3.3): `probs_from_logits` turns target logits into p_t, and
`dspark.verify.acceptance` checks draft tokens against it. A drafter's own distribution q is
whatever it sampled from (SGLang samples drafts from the unfiltered `softmax(L / T)`); rejection
sampling is exact for any q, so q never has to be filtered the same way.

Order of the filters (SGLang's order): temperature, then top-k, then top-p. Each filter is followed by
renormalisation, so top-p measures mass inside the top-k-renormalised distribution (the common
convention, e.g. vLLM's; a sampler that cuts top-p on the un-renormalised mass keeps more tokens). Ties are resolved by value, never by sort order (our choice): every token
whose probability equals the k-th largest survives top-k, and every token whose probability equals
that of the token crossing `top_p` survives top-p. The kept set is therefore a function of the
probabilities alone (permutation-equivariant), so the target distribution is well defined even when
logits tie.

Shape symbols: V vocabulary, `...` any leading batch dimensions, R rows of dim 0 when a sequence
of per-request generators is passed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch

Generators = torch.Generator | Sequence[torch.Generator]

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed accepts seeds in [0, 2**64)


# The smallest normal float32: a smaller positive temperature rounds to 0 (or a denormal) in the
# float32 division below and turns the argmax row into 0/0 = NaN.
MIN_TEMPERATURE = 1.1754944e-38


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated once at construction.

    Parameters
    ----------
    temperature : float
        0 means greedy (argmax, ties to the lowest token id); > 0 divides the logits.
    top_p : float
        Nucleus mass in (0, 1]; 1 disables the filter.
    top_k : int
        Keep the k most likely tokens (ties at the k-th value kept); 0 disables the filter.
    seed : int or None
        Seed of the request's private generator (`make_generator`); None draws one from the OS.

    Raises
    ------
    ValueError
        Naming the argument: negative, NaN or infinite temperature; top_p outside (0, 1];
        negative or non-integer top_k; a seed that is not an int in [0, 2**64).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, Real) or not 0.0 < p <= 1.0:  # NaN fails too
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, Integral) or not 0 <= s < _SEED_LIMIT):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {s!r}")
        # Store plain Python scalars so equal params compare and hash equal whatever the caller passed.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "seed", None if s is None else int(s))

    @property
    def greedy(self) -> bool:
        """True when the target distribution is the one-hot argmax (temperature 0)."""
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator on `device`, seeded with `seed` (or from the OS when `seed` is None)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution p_t defined by `params`.

    Temperature, then top-k, then top-p, renormalising after each filter (module docstring).
    Temperature 0 gives the one-hot of `torch.argmax` (ties to the lowest index) and ignores top-k
    and top-p, whose kept sets always contain the argmax.

    Parameters
    ----------
    logits : floating tensor [..., V]
        Any float dtype; computed in float32. `-inf` entries are allowed (masked tokens) as long as
        every row has a finite maximum; NaN propagates.
    params : SamplingParams

    Returns
    -------
    probs : float32 [..., V]
        Rows sum to 1 (up to rounding); filtered tokens are exactly 0.
    """
    if not torch.is_floating_point(logits) or logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be a floating tensor [..., V] with V >= 1, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    x = logits.float()
    if params.greedy:
        return _one_hot_argmax(x)
    # Shift before dividing: (x - max) <= 0, so even a tiny temperature gives -inf/0-valued
    # exponents rather than inf - inf = NaN.
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature
    probs = torch.softmax(x, dim=-1)  # [..., V]
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = probs.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        probs = _keep_at_least(probs, kth)
    if params.top_p < 1.0:
        # Skipped at exactly 1: rounding in the cumulative sum could otherwise drop tiny tail tokens.
        desc = probs.sort(dim=-1, descending=True).values  # [..., V]
        # Exclusive cumsum as the inclusive one shifted right (not cumsum - desc), so it is exactly
        # non-decreasing and `mass_before < top_p` is a prefix of the sorted order.
        inclusive = torch.cumsum(desc, dim=-1)
        mass_before = torch.cat([torch.zeros_like(desc[..., :1]), inclusive[..., :-1]], dim=-1)
        # >= 1 even when top_p rounds to 0 in float32: the most likely token is always kept.
        n_keep = (mass_before < params.top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
        crossing = desc.gather(-1, n_keep - 1)  # [..., 1] the token whose mass crosses top_p
        probs = _keep_at_least(probs, crossing)
    return probs


def _keep_at_least(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Zero entries below `threshold` [..., 1] and renormalise."""
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float32)
    return out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)


# Rows at least this long are reduced in two passes (`greedy`): on the H200 torch's argmax of one
# 129K-entry row took ~27 µs (`bench/results/graph-draft-h200-s10-profile.log`: five calls per DSpark
# propose), a single-row reduction with little of the GPU busy.
TWO_PASS_MIN = 1 << 15
# ... and at most this many rows: timed on the H200 over 129K-entry rows (`bench/argmax_rows.py`,
# `bench/results/argmax-rows-h200.json`), two passes took 12.9 / 13.7 / 14.4 / 28.3 / 77.6 µs at
# 1 / 4 / 8 / 64 / 256 rows against torch's 37.5 / 38.4 / 38.6 / 43.4 / 54.6 µs: 2.9× at one row, 1.5×
# at 64, 0.70× at 256, where one reduction per row already fills the GPU.
TWO_PASS_MAX_ROWS = 64
_TWO_PASS_CHUNKS = (256, 128, 64)  # chunk counts tried, in order; one must divide V


def greedy(logits_or_probs: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension; ties go to the lowest index (torch.argmax semantics).

    Few long rows (V >= TWO_PASS_MIN, V divisible by one of `_TWO_PASS_CHUNKS`, at most
    TWO_PASS_MAX_ROWS rows) run in two passes: the
    first maximum of each of c chunks, then the first chunk holding the row's maximum. The first
    maximum of that chunk is the row's first maximum, so the result equals torch.argmax (NaN counts
    as the maximum in both passes, as in torch.argmax). Many short reductions keep more of a GPU busy
    than one long one; no host sync.

    Shape: [..., V] (any dtype) -> LongTensor [...].
    """
    x = logits_or_probs
    vocab = x.shape[-1] if x.dim() else 0
    rows = x.numel() // vocab if vocab else 0
    chunks = next((c for c in _TWO_PASS_CHUNKS if vocab % c == 0), None) if vocab >= TWO_PASS_MIN else None
    if chunks is None or not 0 < rows <= TWO_PASS_MAX_ROWS:
        return x.argmax(dim=-1)
    values, inner = x.reshape(*x.shape[:-1], chunks, vocab // chunks).max(dim=-1)  # [..., c] first maxima
    chunk = values.argmax(dim=-1, keepdim=True)  # [..., 1] the first chunk holding the row maximum
    return torch.add(inner.gather(-1, chunk), chunk, alpha=vocab // chunks).squeeze(-1)


def exponential_noise(shape: torch.Size | tuple[int, ...], generator: Generators,
                      device: torch.device | str) -> torch.Tensor:
    """i.i.d. Exp(1) draws, float32 `shape`, from one generator or one generator per row of dim 0.

    With a sequence of R generators, row r is drawn from generator r only, so a request's random
    stream does not depend on which other requests share its batch. Values are clamped away from 0
    so that `probs / noise` never forms 0/0.
    """
    if isinstance(generator, torch.Generator):
        noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    else:
        gens = list(generator)
        if len(shape) == 0 or len(gens) != shape[0]:
            raise ValueError(f"generator: got {len(gens)} generators for leading dimension "
                             f"{shape[0] if len(shape) else 'none'} of shape {tuple(shape)}")
        rows = [torch.empty(shape[1:], dtype=torch.float32, device=device).exponential_(generator=g)
                for g in gens]
        noise = torch.stack(rows) if rows else torch.empty(shape, dtype=torch.float32, device=device)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def uniform_noise(shape: torch.Size | tuple[int, ...], generator: Generators,
                  device: torch.device | str) -> torch.Tensor:
    """i.i.d. U[0, 1) draws, float32 `shape`; generator conventions as in `exponential_noise`."""
    if isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, dtype=torch.float32, device=device)
    gens = list(generator)
    if len(shape) == 0 or len(gens) != shape[0]:
        raise ValueError(f"generator: got {len(gens)} generators for leading dimension "
                         f"{shape[0] if len(shape) else 'none'} of shape {tuple(shape)}")
    rows = [torch.rand(shape[1:], generator=g, dtype=torch.float32, device=device) for g in gens]
    return torch.stack(rows) if rows else torch.empty(shape, dtype=torch.float32, device=device)


def sample(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """Draw one token per row of `probs` without a host sync (exponential race).

    `argmax_v probs[v] / E_v` with E_v ~ Exp(1) i.i.d. is distributed as `probs / probs.sum()`
    (equivalently the Gumbel-max trick on log-probs), so rows need not be normalised and no
    cumulative sum, `.item()` or global RNG is involved.

    Parameters
    ----------
    probs : floating tensor [..., V]
        Non-negative weights; every row must have positive mass (an all-zero row returns 0).
    generator : torch.Generator or sequence of R torch.Generator
        On `probs.device`. A sequence gives row r of dim 0 its own stream (per-request seeding).

    Returns
    -------
    tokens : LongTensor [...]
    """
    if not torch.is_floating_point(probs) or probs.dim() < 1:
        raise ValueError(f"probs must be a floating tensor [..., V], got {probs.dtype} {tuple(probs.shape)}")
    noise = exponential_noise(probs.shape, generator, probs.device)  # [..., V]
    return greedy(probs.float() / noise)


def sample_from_logits(logits: torch.Tensor, params: SamplingParams, generator: Generators) -> torch.Tensor:
    """`greedy(logits)` when `params.greedy` (no random draws), else `sample(probs_from_logits(...))`.

    Shape: logits [..., V] -> LongTensor [...].
    """
    if params.greedy:
        return greedy(logits)
    return sample(probs_from_logits(logits, params), generator)
