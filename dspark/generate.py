"""`dspark.generate`: the reference decoding loop over a batch of prompts.

Plain decoding (`draft_tokens=0`) runs one ragged target call per step over all live requests.
Every request owns a rewindable `DecodeState`; prompts are prefilled in chunks so that a long prompt
never materialises more than `prefill_chunk` rows of attention scores at once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from dspark.sampling import SamplingParams, probs_from_logits, sample
from dspark.tokenizer import as_text_codec


@dataclass
class GenerationStats:
    """Per-request decoding statistics.

    `rounds` counts target calls after the prompt (verify steps); `tau` = tokens committed per round,
    bonus token included (1.0 for plain decoding); the first new token comes from the prefill call and
    belongs to no round. `accept_hist[j]` counts rounds that accepted j
    drafts; `position_accepts[k]` counts rounds whose draft k was accepted; `rejected_tokens` counts
    drafts that were verified but rejected.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accept_hist: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    rejected_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        return (self.new_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens)
    stats: GenerationStats


@dataclass
class _Request:
    """Host-side bookkeeping of one prompt (no tensors beyond its decode state)."""

    prompt: list[int]
    state: object
    generator: torch.Generator
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)


def _eos_ids(config) -> frozenset[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _encode_prompts(model, prompt) -> tuple[list[list[int]], bool]:
    """Normalise `prompt` to a list of token-id lists; returns (prompts, was_batch)."""
    codec = as_text_codec(getattr(model, "tokenizer", None))
    batch = isinstance(prompt, list) and len(prompt) > 0 and not isinstance(prompt[0], int)
    items = prompt if batch else [prompt]
    if isinstance(prompt, list) and len(prompt) == 0:
        raise ValueError("prompt: empty list")
    vocab = model.config.vocab_size
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if codec is None:
                raise ValueError(f"prompt[{i}]: a string needs a model with a tokenizer; pass token ids")
            item = codec.encode(item)
        if not isinstance(item, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise ValueError(f"prompt[{i}]: expected a string or a list of ints, got {type(item).__name__}")
        if len(item) == 0:
            raise ValueError(f"prompt[{i}]: empty prompt")
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt[{i}]: token id {bad[0]} outside the vocabulary [0, {vocab})")
        out.append(list(item))
    return out, batch


def _check_args(model, prompts, max_new_tokens, draft_tokens, prefill_chunk):
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    if draft_tokens != 0:
        raise ValueError(f"draft_tokens={draft_tokens!r}: speculative decoding is not available yet; use 0")
    limit = model.config.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise ValueError(
                f"prompt[{i}]: {len(p)} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                f"max_position_embeddings={limit}")


@torch.inference_mode()
def _forward_last(model, requests: list[_Request], chunks: list[list[int]]) -> torch.Tensor:
    """Feed `chunks[b]` to request b in one ragged call; returns the last row's logits [B, V]."""
    device = next(model.parameters()).device
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
    lens = [len(c) for c in chunks]
    logits = model(ids, [r.state for r in requests], lens).logits  # [N, V]
    last = torch.tensor(lens, device=device).cumsum(0) - 1
    return logits[last]


def _prefill(model, requests: list[_Request], chunk: int) -> torch.Tensor:
    """Chunked prefill of every prompt; returns each request's last-prompt-row logits [B, V]."""
    last = [None] * len(requests)
    for start in range(0, max(len(r.prompt) for r in requests), chunk):
        live = [i for i, r in enumerate(requests) if len(r.prompt) > start]
        rows = _forward_last(model, [requests[i] for i in live],
                             [requests[i].prompt[start:start + chunk] for i in live])
        for j, i in enumerate(live):
            last[i] = rows[j]
    return torch.stack(last)


def _pick(logits: torch.Tensor, requests: list[_Request], params: SamplingParams) -> list[int]:
    """Choose the next token of each request from its target logits [B, V]."""
    if params.temperature == 0.0:
        return logits.argmax(-1).tolist()
    probs = probs_from_logits(logits.float(), params)
    return [int(sample(probs[b], r.generator)) for b, r in enumerate(requests)]


def _append(req: _Request, token: int, eos: frozenset[int], max_new: int) -> None:
    req.out.append(token)
    req.stats.new_tokens += 1
    if token in eos:
        req.finish_reason = "stop"
    elif len(req.out) >= max_new:
        req.finish_reason = "length"


def generate(model, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, draft_tokens: int = 0, prefill_chunk: int = 512):
    """Generate continuations of `prompt` with `model`.

    Parameters
    ----------
    prompt : str | list[int] | list[str | list[int]]
        One prompt (text needs `model.tokenizer`) or a list of them (a batch).
    max_new_tokens : int
        Upper bound on generated tokens per prompt; generation also stops at EOS (kept in the output).
    temperature, top_p, top_k, seed
        Sampling parameters (`dspark.sampling.SamplingParams`); temperature 0 is greedy.
    draft_tokens : int
        0 = plain autoregressive decoding.

    Returns
    -------
    GenerationOutput, or a list of them when `prompt` is a batch.
    """
    prompts, batched = _encode_prompts(model, prompt)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    _check_args(model, prompts, max_new_tokens, draft_tokens, prefill_chunk)
    eos = _eos_ids(model.config)
    base_seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    requests = [_Request(p, model.new_state(), torch.Generator().manual_seed(base_seed + i))
                for i, p in enumerate(prompts)]

    t0 = time.perf_counter()
    first = _pick(_prefill(model, requests, prefill_chunk), requests, params)
    t1 = time.perf_counter()
    for req, tok in zip(requests, first):
        req.stats.prompt_tokens, req.stats.prefill_s = len(req.prompt), t1 - t0
        _append(req, tok, eos, max_new_tokens)

    live = [r for r in requests if r.finish_reason is None]
    while live:
        t = time.perf_counter()
        nxt = _pick(_forward_last(model, live, [[r.out[-1]] for r in live]), live, params)
        dt = time.perf_counter() - t
        for req, tok in zip(live, nxt):
            req.stats.rounds += 1
            req.stats.decode_s += dt
            _append(req, tok, eos, max_new_tokens)
        live = [r for r in live if r.finish_reason is None]

    codec = as_text_codec(getattr(model, "tokenizer", None))
    outs = [GenerationOutput(r.out, codec.decode(r.out) if codec else None, r.finish_reason, r.stats)
            for r in requests]
    return outs if batched else outs[0]
