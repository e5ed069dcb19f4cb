"""The Markov chain of a DSpark block drafted on the device, with per-slot temperatures and one
generator: what the static drafter samples with (the dynamic path's is `markov_head.sample_chain`).

Same chain as `sample_chain` (dspark spec §2.2 step 3): L_k = U_k + B(x_{k−1}), x_{−1} = the anchor,

    greedy rows (temperature 0)   x_k = argmax L_k,            q_k = one-hot(x_k)
    sampled rows (temperature t)  q_k = softmax(L_k / t) fp32, x_k = argmax q_k / E_k,  E_k ~ Exp(1)

The exponential race draws an exact sample of q_k without a cumulative sum or a host read. The
noise of all slots comes from one `torch.Generator` on the drafter's device (the dynamic path draws
each request's from its own generator on the host), so a request's draws depend on its slot and on
the step, not on its seed: verification stays exact because q_k is returned and is the distribution
x_k was drawn from. Which rows are greedy is data (`temperature == 0`), so one call serves a bucket
of mixed requests with the same launches.

Shape symbols: S slots (blocks), γ slots per block, V vocabulary, D hidden size, r Markov rank.
"""

from __future__ import annotations

import torch

from dspark.draft.markov_head import MarkovHead
from dspark.sampling import greedy


def sample_chain_static(head: MarkovHead, base: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                        temperature: torch.Tensor | None, generator: torch.Generator | None):
    """Draft the block left to right on the device, as many slots k as `base` holds (γ, or the first
    k < γ a static drafter built for fewer drafts computes).

    Parameters
    ----------
    base : fp32 [S, k, V] base logits U_k;  hidden : [S, k, D] the RNN head's input
    anchors : LongTensor [S], x_{−1}
    temperature : fp32 [S] (0 = greedy row, else > 0; values trusted: no host read), or None for an
        all-greedy call that draws no noise and returns no q
    generator : torch.Generator on base's device; required when `temperature` is given

    Returns
    -------
    tokens LongTensor [S, k]; probs fp32 [S, k, V] (q_k; one-hot on greedy rows) or None when
    `temperature` is None; prev_embeddings fp32 [S, k, r] = W1[x_{k−1}].
    """
    n_slots, gamma, _ = base.shape
    if temperature is not None:
        if generator is None:
            raise ValueError("generator: required when temperature is given (sampled rows draw noise)")
        greedy_row, t = row_temperatures(temperature)
    state = head.init_state(n_slots, base.device)
    prev = anchors
    tokens, probs, embeds = [], [], []
    for k in range(gamma):
        embeds.append(head.embed(prev))  # W1[x_{k−1}]
        if temperature is None:  # the head's greedy slot (the vanilla head's: one fused op on CUDA)
            prev, state = head.greedy_next(state, prev, embeds[-1], hidden[:, k], base[:, k])
        else:
            bias, state = head.step(state, prev, hidden[:, k])
            prev, q = pick_static(base[:, k].float() + bias, greedy_row, t, generator)  # logits [S, V]
            probs.append(q)
        tokens.append(prev)
    return (torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None,
            torch.stack(embeds, dim=1))


def row_temperatures(temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """temperature fp32 [S] (0 = greedy) -> (greedy_row bool [S, 1], t fp32 [S, 1]: 1 on greedy rows,
    where any finite value serves) for `pick_static`."""
    greedy_row = (temperature == 0)[:, None]  # [S, 1]
    return greedy_row, torch.where(greedy_row, 1.0, temperature[:, None].float())


def pick_static(logits: torch.Tensor, greedy_row: torch.Tensor, t: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits fp32 [S, V]: argmax on greedy rows (greedy_row bool [S, 1]), an
    exponential-race sample of q = softmax(logits / t) elsewhere (t fp32 [S, 1], any finite value on
    greedy rows; noise from `generator`). Returns (tokens long [S], q fp32 [S, V]: one-hot on greedy
    rows). No host read."""
    best = greedy(logits)
    q = torch.softmax(logits / t, dim=-1)  # [S, V]
    noise = torch.empty_like(q).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    tokens = torch.where(greedy_row[:, 0], best, greedy(q / noise))
    one_hot = torch.zeros_like(q).scatter_(-1, best[:, None], 1.0)
    return tokens, torch.where(greedy_row, one_hot, q)
