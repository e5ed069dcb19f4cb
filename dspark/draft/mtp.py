"""MTP-1 drafting with the target's own next-token block `mtp.0` (deepseek_v4 spec §12).

The MTP block predicts token t+2 from the pair (X_t, token t+1): the target's final streams at
position t and the embedding of the token after it. Its sliding-window state advances in step with
the target, one pair per committed position, so it is fed here only with committed pairs:

    observe(rows t0 .. t0+n−1)   pairs (X_{t0−1}, tok_{t0}), .., (X_{t0+n−2}, tok_{t0+n−1})
                                 at MTP positions t0−1 .. t0+n−2; X_{t0+n−1} waits for its next token
    propose(anchor a at L)       (X_{L−1}, a) at position L−1 -> logits of x_0 (token L+1); for a chain of
                                 depth k the block's own output streams and x_{j−1} make the next pair

`propose` runs on copies of the states (the chain's pairs are speculative), so a state never holds
a drafted row. The default block size 1 is the production "MTP-1" baseline (verify 2 tokens).
Without a confidence head every draft reports the constant `confidence`.

Shape symbols: B requests, k block size, V vocabulary, n_hc streams, D hidden size, n committed rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from dspark.draft.base import DraftProposal
from dspark.draft.markov_head import sample_per_request
from dspark.sampling import SamplingParams


@dataclass
class MtpState:
    """The MTP block's decode state of one request plus the newest committed streams, whose pair
    (they need the *next* committed token) is not complete yet.

    pending : [n_hc, D] final target streams of the last committed position, or None before any row.
    """

    state: object
    pending: torch.Tensor | None = None


class MtpDrafter:
    """Drafter over `target.mtp[depth]`.

    block_size : drafted tokens per round (1 = MTP-1; k > 1 chains the block on its own output).
    confidence : c_k reported for every draft, in (0, 1].
    """

    capture_layers: tuple[int, ...] = ()

    def __init__(self, target, block_size: int = 1, depth: int = 0, confidence: float = 0.7):
        if not len(getattr(target, "mtp", ())):
            raise ValueError("target: has no MTP block (num_nextn_predict_layers = 0)")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not 0 <= depth < len(target.mtp):
            raise ValueError(f"depth {depth} outside [0, {len(target.mtp)})")
        if not 0.0 < confidence <= 1.0:
            raise ValueError(f"confidence must lie in (0, 1], got {confidence!r}")
        self.target = target
        self.block_size = block_size
        self.depth = depth
        self.confidence = float(confidence)

    def new_state(self) -> MtpState:
        return MtpState(self.target.new_mtp_state(self.depth))

    @torch.no_grad()
    def observe(self, dstate: MtpState, token_ids: torch.Tensor, hidden: torch.Tensor, features=None) -> None:
        """Feed the committed pairs these n rows complete: token_ids [n], hidden [n, n_hc, D]."""
        n = int(token_ids.shape[0])
        if n == 0:
            return
        if dstate.pending is None:  # the very first row has no predecessor: it only becomes pending
            streams, tokens = hidden[:-1], token_ids[1:]
        else:
            streams, tokens = torch.cat((dstate.pending[None], hidden[:-1])), token_ids
        if tokens.numel():
            self.target.forward_mtp(streams, tokens.to(self.target.device), [dstate.state], [tokens.numel()],
                                    depth=self.depth)
        dstate.pending = hidden[-1].clone()

    @torch.no_grad()
    def propose(self, dstates: list[MtpState], anchors: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> DraftProposal:
        if any(s.pending is None for s in dstates):
            raise ValueError("propose: a request has no committed row yet (observe the prompt first)")
        device = self.target.device
        states = [copy.deepcopy(s.state) for s in dstates]  # the chain's rows are speculative
        streams = torch.stack([s.pending for s in dstates])  # [B, n_hc, D]
        prev = torch.tensor(anchors, dtype=torch.long, device=device)
        tokens, probs = [], []
        for _ in range(self.block_size):
            out = self.target.forward_mtp(streams, prev, states, [1] * len(states), depth=self.depth)
            if params.greedy:
                prev = out.logits.argmax(dim=-1)
            else:
                q = torch.softmax(out.logits / params.temperature, dim=-1)  # fp32 [B, V]
                prev = sample_per_request(q, generators)
                probs.append(q)
            tokens.append(prev)
            streams = out.hidden  # the block's own output streams feed the next link of the chain
        token_block = torch.stack(tokens, dim=1)
        conf = torch.full(token_block.shape, self.confidence, dtype=torch.float32)
        return DraftProposal(token_block, torch.stack(probs, dim=1) if probs else None, conf)
