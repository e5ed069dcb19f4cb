"""`dspark.generate`: the reference decoding loop, plain or speculative, over a batch of prompts.

One speculative round (DSpark paper §2–3; specs/dspark.md §2.2–2.4) is four named calls:

    draft   the drafter proposes a full γ-block per request from its anchor (the last committed token)
    plan    the planner chooses how many of the γ drafts each request sends to the target (ℓ_r)
    verify  one ragged target call over [anchor, x_0 .. x_{ℓ-1}] per request, then exact acceptance
    commit  rewind the target state to anchor + accepted drafts, feed those rows to the drafter,
            append accepted drafts + the correction/bonus token

Plain decoding (`draft_tokens=0`) is the same round with ℓ_r = 0 and no drafter. Every request owns a
rewindable `DecodeState`; prompts are prefilled in chunks of `prefill_chunk` tokens.
"""

from __future__ import annotations

import os
import time

import torch

from dspark.draft import resolve_drafter
from dspark.request import GenerationOutput, GenerationStats, Request
from dspark.sampling import SamplingParams, probs_from_logits, sample
from dspark.tokenizer import as_text_codec
from dspark.verify.acceptance import verify_chain
from dspark.verify.capacity import CapacityTable, default_cpu_table
from dspark.verify.planner import VerifyPlan, plan_algorithm1, plan_async, plan_fixed
from dspark.validate import check_generate_args, encode_prompts

__all__ = ["GenerationOutput", "GenerationStats", "generate"]


def _forward(model, requests: list[Request], chunks: list[list[int]], capture: tuple[int, ...]):
    """Feed `chunks[b]` to request b in one ragged target call; returns (output, row offsets)."""
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=model.device)
    lens = [len(c) for c in chunks]
    out = model(ids, [r.state for r in requests], lens, capture_layers=capture)
    offsets = [sum(lens[:b]) for b in range(len(lens))]
    return out, offsets


def _observe(drafter, req: Request, out, rows: slice, tokens: list[int]) -> None:
    if drafter is not None:
        drafter.observe(req.dstate, torch.tensor(tokens), out.hidden[rows],
                        {i: f[rows] for i, f in out.features.items()})


def _pick(logits: torch.Tensor, req: Request, params: SamplingParams) -> int:
    """Next token from one row of target logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    return int(sample(probs_from_logits(logits.float(), params), req.generator))


def _prefill(model, drafter, requests: list[Request], chunk: int, params: SamplingParams) -> None:
    """Chunked prefill of every prompt, then the first token of each request."""
    capture = drafter.capture_layers if drafter is not None else ()
    last = [None] * len(requests)
    for start in range(0, max(len(r.prompt) for r in requests), chunk):
        live = [b for b, r in enumerate(requests) if len(r.prompt) > start]
        pieces = [requests[b].prompt[start:start + chunk] for b in live]
        out, offsets = _forward(model, [requests[b] for b in live], pieces, capture)
        for b, piece, off in zip(live, pieces, offsets):
            _observe(drafter, requests[b], out, slice(off, off + len(piece)), piece)
            last[b] = out.logits[off + len(piece) - 1]
    for req, logits in zip(requests, last):
        req.stats.prompt_tokens = len(req.prompt)
        req.commit([_pick(logits, req, params)])


def _plan(live: list[Request], confidence: torch.Tensor, draft_tokens, planner: str,
          capacity: CapacityTable, gamma: int) -> VerifyPlan:
    """ℓ_r per request; never more drafts than the request can still commit."""
    caps = [min(gamma, r.remaining - 1) for r in live]
    if draft_tokens != "auto":
        return plan_fixed(draft_tokens, gamma, len(live), caps)
    if planner == "async":
        stale = [r.confidences[0] if len(r.confidences) == 2 else None for r in live]
        return plan_async(confidence, stale, capacity, caps)
    return plan_algorithm1(confidence, capacity, caps)


def _round(model, drafter, live: list[Request], params: SamplingParams, draft_tokens, planner, capacity):
    """One draft → plan → verify → commit round over every live request."""
    anchors = [r.out[-1] for r in live]
    if drafter is None:
        drafts, probs, plan = None, None, VerifyPlan((0,) * len(live))
    else:
        proposal = drafter.propose([r.dstate for r in live], anchors, params, [r.generator for r in live])
        drafts, probs = proposal.tokens.tolist(), proposal.probs
        confidence = proposal.confidence.float().cpu()
        plan = _plan(live, confidence, draft_tokens, planner, capacity, drafter.block_size)
        for r, c in zip(live, confidence):
            r.confidences.append(c)
    blocks = [[a] + (drafts[b][:n] if drafts else []) for b, (a, n) in enumerate(zip(anchors, plan.draft_lens))]
    starts = [r.state.length for r in live]
    out, offsets = _forward(model, live, blocks, drafter.capture_layers if drafter else ())
    for b, (req, block, off) in enumerate(zip(live, blocks, offsets)):
        n = len(block) - 1
        q = probs[b, :n] if probs is not None else None
        accepted, nxt = verify_chain(torch.tensor(block[1:], dtype=torch.long), q,
                                     out.logits[off:off + n + 1], params, req.generator)
        accepted = int(accepted)
        req.state.truncate(starts[b] + 1 + accepted)
        _observe(drafter, req, out, slice(off, off + accepted + 1), block[:accepted + 1])
        req.stats.record_round(n, accepted, drafter.block_size if drafter else 0)
        req.commit(block[1:accepted + 1] + [int(nxt)])


def generate(model, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, draft_tokens: int | str = 0, drafter=None,
             planner: str = "sync", capacity: CapacityTable | None = None, prefill_chunk: int = 512):
    """Generate continuations of `prompt` with `model`, exactly as the target alone would.

    Parameters
    ----------
    prompt : str | list[int] | list[str | list[int]]
        One prompt (text needs `model.tokenizer`) or a list of them (a batch).
    max_new_tokens : int
        Upper bound on generated tokens per prompt; generation also stops at EOS (kept in the output).
    temperature, top_p, top_k, seed
        Sampling parameters of the target distribution (`dspark.sampling.SamplingParams`); 0 = greedy.
    draft_tokens : int in [0, γ] or "auto"
        Verification budget per round: 0 is plain decoding; n verifies the first n of the γ drafted
        tokens; "auto" lets the confidence-scheduled planner choose per request.
    drafter : None | "dspark" | "mtp" | "ngram" | Drafter
        None picks the model's DSpark stages, else its MTP block, else n-gram lookup.
    planner : "sync" (paper Algorithm 1) or "async" (budget from confidences two rounds old)
        Used with draft_tokens="auto", over `capacity` (default: the shipped CPU table).

    Returns
    -------
    GenerationOutput (token_ids, text, finish_reason, stats), or a list of them for a batch.
    """
    prompts, batched = encode_prompts(model, prompt)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    drafter = resolve_drafter(model, drafter) if draft_tokens != 0 else None
    check_generate_args(model, prompts, max_new_tokens, draft_tokens, drafter, planner, prefill_chunk)
    capacity = capacity or default_cpu_table()
    eos = frozenset(_eos_ids(model.config))
    base_seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    requests = [Request(p, model.new_state(), torch.Generator().manual_seed(base_seed + i), max_new_tokens, eos,
                        drafter.new_state() if drafter else None) for i, p in enumerate(prompts)]

    t0 = time.perf_counter()
    _prefill(model, drafter, requests, prefill_chunk, params)
    for r in requests:
        r.stats.prefill_s = time.perf_counter() - t0
    live = [r for r in requests if r.finish_reason is None]
    while live:
        t = time.perf_counter()
        _round(model, drafter, live, params, draft_tokens, planner, capacity)
        for r in live:
            r.stats.decode_s += time.perf_counter() - t
        live = [r for r in live if r.finish_reason is None]

    codec = as_text_codec(getattr(model, "tokenizer", None))
    outs = [GenerationOutput(r.out, codec.decode(r.out) if codec else None, r.finish_reason, r.stats)
            for r in requests]
    return outs if batched else outs[0]


def _eos_ids(config) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
