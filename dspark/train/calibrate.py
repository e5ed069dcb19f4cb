"""STS calibration of a drafter's confidence head from recorded verify-all rounds (dspark spec §4.4).

STS needs, per round, the raw confidence logits z_1..z_γ and the number of drafts the target
accepted when *all γ* were verified (a shorter verification censors the label, §11 pitfall 7), at
the serving temperature. `StsRecorder` wraps any drafter whose proposals carry
`confidence_logits` and records exactly that while `dspark.generate` runs with `draft_tokens = γ`:

    propose   keep z of each request whose round verifies the full block
    observe   the committed rows after that verify are the anchor + the A accepted drafts: A = n − 1

A round verifies fewer than γ drafts only when the request is about to hit `max_new_tokens`
(ℓ = min(γ, remaining − 1)); the recorder knows each request's output length from the rows it
has seen, and skips those rounds. `calibrate_sts` runs the rounds and fits the temperatures
(`dspark.verify.sts.fit_sts`).

Shape symbols: N recorded rounds, γ block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.draft.base import DraftProposal
from dspark.generate import generate
from dspark.sampling import SamplingParams
from dspark.verify.sts import StsCalibration, fit_sts


@dataclass
class _RecordingState:
    """The wrapped drafter's state plus this request's bookkeeping.

    rows : committed rows observed; prompt_rows : rows observed before the first round (the prompt);
    pending : fp32 [γ] raw logits of the round awaiting its accepted count, or None.
    """

    inner: object
    rows: int = 0
    prompt_rows: int | None = None
    pending: torch.Tensor | None = None


class StsRecorder:
    """A drafter that forwards to `drafter` and records (z, accepted) of full verify-all rounds.

    `max_new_tokens` must be the value passed to `generate`, so the recorder can tell which rounds
    were shortened by the length limit.
    """

    def __init__(self, drafter, max_new_tokens: int):
        self.inner = drafter
        self.block_size = drafter.block_size
        self.capture_layers = drafter.capture_layers
        self.max_new_tokens = max_new_tokens
        self.logits: list[torch.Tensor] = []
        self.accepted: list[int] = []

    def new_state(self) -> _RecordingState:
        return _RecordingState(self.inner.new_state())

    def observe(self, dstate: _RecordingState, token_ids: torch.Tensor, hidden: torch.Tensor, features) -> None:
        self.inner.observe(dstate.inner, token_ids, hidden, features)
        n = int(token_ids.shape[0])
        if dstate.pending is not None:
            self.logits.append(dstate.pending)
            self.accepted.append(n - 1)  # the anchor plus the accepted drafts were committed
            dstate.pending = None
        dstate.rows += n

    def propose(self, dstates: list[_RecordingState], anchors: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> DraftProposal:
        proposal = self.inner.propose([s.inner for s in dstates], anchors, params, generators)
        if proposal.confidence_logits is None:
            raise ValueError("drafter: its proposals carry no confidence_logits; STS needs a confidence head")
        for b, state in enumerate(dstates):
            if state.prompt_rows is None:
                state.prompt_rows = state.rows
            produced = state.rows - state.prompt_rows + 1  # output tokens so far, the anchor included
            full_block = self.max_new_tokens - produced - 1 >= self.block_size
            state.pending = proposal.confidence_logits[b].detach().float().cpu() if full_block else None
        return proposal

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits fp32 [N, γ], accepted LongTensor [N]) of the recorded rounds."""
        if not self.accepted:
            raise ValueError("no complete verify-all round was recorded; use longer generations (max_new_tokens)")
        return torch.stack(self.logits), torch.tensor(self.accepted, dtype=torch.long)


def record_rounds(model, drafter, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 1.0,
                  top_p: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify-all rounds of `drafter` on `prompts`: (logits fp32 [N, γ], accepted LongTensor [N])."""
    recorder = StsRecorder(drafter, max_new_tokens)
    generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
             draft_tokens=drafter.block_size, drafter=recorder)
    return recorder.data()


def calibrate_sts(model, drafter, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 1.0,
                  top_p: float = 1.0, seed: int = 0, objective: str = "nll", dataset: str = "") -> StsCalibration:
    """Fit per-position temperatures for `drafter` on held-out `prompts` at the serving sampling
    settings. Returns the calibration; `drafter.set_calibration(cal)` (and `save_drafter`) deploy it."""
    logits, accepted = record_rounds(model, drafter, prompts, max_new_tokens, temperature, top_p, seed)
    return fit_sts(logits, accepted, objective=objective, dataset=dataset, sampling_temperature=temperature)
