"""Host-side bookkeeping of one generation request: its tokens, stop rules and statistics.

Nothing here touches a device; `generate.py` owns the model calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from dspark.sampling import SamplingParams


@dataclass
class GenerationStats:
    """Per-request decoding statistics.

    `rounds` counts target calls after the prompt (verify steps). `tau` = tokens committed per round,
    bonus/correction token included (1.0 for plain decoding); the first new token comes from the
    prefill call and belongs to no round. `accept_hist[j]` counts rounds that accepted j drafts;
    `position_accepts[k]` counts rounds whose draft k was accepted (so `position_accepts[k] /
    rounds` is the unconditional prefix survival); `verified_tokens` counts drafts sent to the target
    and `rejected_tokens` the verified drafts it rejected.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accept_hist: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    verified_tokens: int = 0
    rejected_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    preemptions: int = 0

    @property
    def tau(self) -> float:
        return (self.new_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    def record_round(self, verified: int, accepted: int, block_size: int) -> None:
        if not self.accept_hist:
            self.accept_hist = [0] * (block_size + 1)
            self.position_accepts = [0] * block_size
        self.rounds += 1
        self.accept_hist[accepted] += 1
        for k in range(accepted):
            self.position_accepts[k] += 1
        self.verified_tokens += verified
        self.rejected_tokens += verified - accepted


def summed_counts(per_request: list[list[int]]) -> list[int]:
    """Element-wise sum of per-request count lists (`accept_hist`, `position_accepts`) of a batch;
    a request that ended before its first round has an empty list and adds nothing."""
    width = max((len(c) for c in per_request), default=0)
    return [sum(c[k] for c in per_request if k < len(c)) for k in range(width)]


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens)
    stats: GenerationStats


@dataclass(eq=False)
class Request:
    """One prompt in flight.

    `state` is the target's rewindable decode state, `dstate` the drafter's (None for plain
    decoding). `out[-1]` is the anchor of the next round: committed, not yet fed to the target.
    `feed` is what prefill feeds: the prompt, or after a preemption the prompt plus every committed
    token but the anchor; `prefilled` counts the tokens of `feed` already fed (chunked prefill).
    `confidences` keeps the last two rounds' draft confidences for the asynchronous planner;
    `plain_run` counts the plain rounds in a row "auto" ran for it and `plain_probes` the plain probes
    in a row that ended them, `plain_plan` holds the stale rows of the last round that planned it plain
    (one tuple shared by that round's requests), and `unobserved` the committed rows of its plain rounds
    that the drafter has not observed yet (`dspark.round`). `domain` is a free-form tag (e.g. the
    evaluation set) copied into every round trace record so analyses can group by it.
    """

    prompt: list[int]
    state: object
    generator: torch.Generator
    max_new: int
    eos: frozenset[int]
    params: SamplingParams = SamplingParams()
    dstate: object = None
    request_id: str = ""
    domain: str = ""
    prefilled: int = 0
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    confidences: deque = field(default_factory=lambda: deque(maxlen=2))
    plain_run: int = 0
    plain_probes: int = 0
    plain_plan: tuple | None = None
    unobserved: list = field(default_factory=list)
    feed: list[int] | None = None

    def __post_init__(self):
        if self.feed is None:
            self.feed = list(self.prompt)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.feed)

    @property
    def fed_length(self) -> int:
        """Tokens the target state holds once prefill is done: prompt + output − the anchor."""
        return len(self.prompt) + max(len(self.out) - 1, 0)

    def keep_confidences(self) -> None:
        """After a plain round of "auto" (no drafts, no confidences): repeat the newest drafting round's
        row, so the row two rounds back stays the newest one the planner can read (none: stays none)."""
        if self.confidences:
            self.confidences.append(self.confidences[-1])

    def preempt(self) -> None:
        """Drop the device state; the next prefill rebuilds it from prompt + output − the anchor,
        after which decoding resumes from the same anchor (nothing is sampled again)."""
        self.state = self.dstate = None
        self.feed = self.prompt + self.out[:-1]
        self.prefilled = 0
        self.confidences.clear()  # the asynchronous planner treats the rebuilt request as new
        self.plain_run = self.plain_probes = 0
        self.plain_plan = None
        self.unobserved = []
        self.stats.preemptions += 1

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.out)

    def commit(self, tokens: list[int]) -> int:
        """Append `tokens` up to and including the first EOS or the length limit; returns how many
        were kept (an accepted EOS ends the round without its bonus token)."""
        kept = 0
        for token in tokens:
            self.out.append(token)
            kept += 1
            if token in self.eos:
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        self.stats.new_tokens += kept
        return kept
