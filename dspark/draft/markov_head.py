"""DSpark's sequential stage: a low-rank logit bias from the previous token (dspark spec §1.6).

The parallel backbone gives base logits U_k for every slot at once; the Markov head adds a bias that
depends on the token drafted just before, B_k = W2 · W1[x_{k−1}] (x_{−1} = the anchor), so drafts are
sampled strictly left to right:

    L_k = U_k + B_k          (before temperature, spec §11 pitfall 5)
    q_k = softmax(L_k / T)   in fp32; x_k ~ q_k, or argmax at T = 0

The bias is local (one softmax per slot), so q_k is an exact distribution and rejection sampling
stays exact. The RNN variant (paper eq. 6) carries a state s_k ∈ R^r through the block:
z = [s_{k−1}; W1[x_{k−1}]; h_k], (g, c, o) = cell(z), s_k = σ(g)⊙s_{k−1} + (1−σ(g))⊙tanh(c),
B_k = W2·tanh(o). Parameter names are the V4 checkpoint's: `markov_head.embed` (W1 [V, r]),
`markov_head.head` (W2 [V, r]); the RNN adds `markov_head.cell` ([3r, 2r + D] with bias). All are
kept in fp32 (the V4 runtime does the same).

A greedy slot of the vanilla head runs the `markov_greedy` op of the drafter's `KernelConfig`
(`greedy_next`): on CUDA one fused kernel (bias on the tensor cores at ≈ fp32, + U_k, argmax; the
[B, V] logits are never written), elsewhere the torch reference, which is the code above op for op.

Shape symbols: B requests (or blocks), γ slots, V vocabulary, r rank, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.sampling import SamplingParams, greedy, sample


class MarkovHead(nn.Module):
    """Vanilla Markov head: B_k = W2 · W1[x_{k−1}]. `kernels`: the drafter's kernel choice (its
    `markov_greedy` op serves `greedy_next`, its `slot_noise` op the static chain's sampled slots,
    `static_chain.sample_chain_static`); None: the torch references."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        self.rank = rank
        self.embed = nn.Embedding(vocab_size, rank, dtype=torch.float32, device=device)
        self.head = nn.Linear(rank, vocab_size, bias=False, dtype=torch.float32, device=device)
        self._markov_greedy = get_op(kernels or KernelConfig(), "markov_greedy")
        self.slot_noise = get_op(kernels or KernelConfig(), "slot_noise")

    def init_state(self, batch: int, device) -> torch.Tensor | None:
        """The vanilla head is stateless."""
        return None

    def step(self, state, prev: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """prev LongTensor [B], hidden [B, D] (unused) -> (bias fp32 [B, V], None)."""
        return self.head(self.embed(prev)), None

    def greedy_next(self, state, prev: torch.Tensor, prev_embed: torch.Tensor, hidden: torch.Tensor,
                    base: torch.Tensor) -> tuple[torch.Tensor, None]:
        """One greedy slot: argmax of U_k + B_k. prev [B], prev_embed fp32 [B, r] = W1[prev], hidden
        [B, D] (unused), base [B, V] -> (tokens LongTensor [B], None)."""
        return self._markov_greedy(base, prev_embed, self.head.weight), None

    def teacher_forced(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """All γ biases at once from the true previous tokens: prev [N, γ] -> fp32 [N, γ, V]."""
        return self.head(self.embed(prev))


class RnnHead(MarkovHead):
    """RNN head (paper eq. 6): a gated state carried left to right through the block."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__(vocab_size, rank, hidden_size, device, kernels)
        self.cell = nn.Linear(2 * rank + hidden_size, 3 * rank, bias=True, dtype=torch.float32, device=device)

    def init_state(self, batch: int, device) -> torch.Tensor:
        return torch.zeros(batch, self.rank, dtype=torch.float32, device=device)

    def step(self, state: torch.Tensor, prev: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state fp32 [B, r], prev [B], hidden [B, D] -> (bias fp32 [B, V], new state [B, r])."""
        z = torch.cat((state, self.embed(prev), hidden.float()), dim=-1)  # [B, 2r + D]
        gate, cand, out = self.cell(z).chunk(3, dim=-1)
        keep = torch.sigmoid(gate)
        state = keep * state + (1 - keep) * torch.tanh(cand)
        return self.head(torch.tanh(out)), state

    def greedy_next(self, state: torch.Tensor, prev: torch.Tensor, prev_embed: torch.Tensor, hidden: torch.Tensor,
                    base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy slot through the gated state (no fused op: the bias depends on the state)."""
        bias, state = self.step(state, prev, hidden)
        return greedy(base.float() + bias), state

    def teacher_forced(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Unrolled over the block: prev [N, γ], hidden [N, γ, D] -> fp32 [N, γ, V]."""
        state = self.init_state(prev.shape[0], prev.device)
        biases = []
        for k in range(prev.shape[1]):
            bias, state = self.step(state, prev[:, k], hidden[:, k])
            biases.append(bias)
        return torch.stack(biases, dim=1)


def build_head(head_type: str, vocab_size: int, rank: int, hidden_size: int, device=None,
               kernels: KernelConfig | None = None) -> MarkovHead:
    if head_type == "markov":
        return MarkovHead(vocab_size, rank, hidden_size, device, kernels)
    if head_type == "rnn":
        return RnnHead(vocab_size, rank, hidden_size, device, kernels)
    raise ValueError(f"dspark_markov_head_type: {head_type!r} is not one of ('markov', 'rnn')")


def sample_chain(head: MarkovHead, base: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                 params: SamplingParams, generators: list[torch.Generator]):
    """Draft the block left to right (spec §2.2 step 3), as many slots k as `base` holds (γ, or the
    first k < γ when the caller verifies no more).

    Parameters
    ----------
    base : fp32 [B, k, V], base logits U_k from the backbone
    hidden : [B, k, D], the head input h_k (used by the RNN head)
    anchors : LongTensor [B], x_{−1}
    params : the request temperature (0 = greedy); top-k / top-p never filter the draft (spec §3.3)
    generators : one per request, row b draws from generators[b] only

    Returns
    -------
    tokens LongTensor [B, k]; probs fp32 [B, k, V] (q_k, the exact sampling distribution) or None
    when greedy; prev_embeddings fp32 [B, k, r] = W1[x_{k−1}] (the confidence head's input).
    """
    batch, gamma, _ = base.shape
    state = head.init_state(batch, base.device)
    prev = anchors
    tokens, probs, embeds = [], [], []
    for k in range(gamma):
        embeds.append(head.embed(prev))  # W1[x_{k−1}]
        if params.greedy:
            prev, state = head.greedy_next(state, prev, embeds[-1], hidden[:, k], base[:, k])
        else:
            bias, state = head.step(state, prev, hidden[:, k])
            q = torch.softmax((base[:, k].float() + bias) / params.temperature, dim=-1)  # [B, V]
            prev = sample_per_request(q, generators)
            probs.append(q)
        tokens.append(prev)
    return (torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None,
            torch.stack(embeds, dim=1))


def sample_per_request(q: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Exponential-race sample of each row of q [B, V] from its own generator.

    The noise is drawn where the generators live (the generate loop keeps them on the CPU), so a
    request's random stream is the same whichever device holds the drafter.
    """
    device = generators[0].device
    return sample(q.to(device), generators).to(q.device)
