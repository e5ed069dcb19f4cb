"""`dspark.generate`: decode a batch of prompts to completion, exactly as the target alone would.

A thin driver over `dspark.engine.Engine`, which advances every request one
draft → plan → verify → commit round per step (`dspark.round` holds the round itself).
"""

from __future__ import annotations

import os

from dspark.engine import Engine, EngineConfig
from dspark.request import GenerationOutput
from dspark.sampling import SamplingParams
from dspark.tokenizer import as_text_codec
from dspark.validate import check_generate_args, encode_prompts
from dspark.verify.capacity import CapacityTable


def generate(model, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, draft_tokens: int | str = 0, drafter=None,
             planner: str = "async", capacity: CapacityTable | None = None, prefill_chunk: int = 512):
    """Generate continuations of `prompt` with `model`.

    Parameters
    ----------
    prompt : str | list[int] | list[str | list[int]]
        One prompt (text needs `model.tokenizer`) or a list of them (a batch).
    max_new_tokens : int
        Upper bound on generated tokens per prompt; generation also stops at EOS (kept in the output).
    temperature, top_p, top_k, seed
        Sampling parameters of the target distribution (`dspark.sampling.SamplingParams`); 0 = greedy.
        Prompt i of a batch draws from its own generator seeded `seed + i`.
    draft_tokens : int in [0, γ] or "auto"
        Verification budget per round: 0 is plain decoding; n verifies the first n of the γ drafted
        tokens; "auto" lets the confidence-scheduled planner choose per request.
    drafter : None | "dspark" | "mtp" | "ngram" | Drafter
        None picks the model's DSpark stages, else its MTP block, else n-gram lookup.
    planner : "async" (default; budget from confidences two rounds old, the production scheme) or
        "sync" (paper Algorithm 1), used with draft_tokens="auto" over `capacity` (default: the
        drafter's own table for the model's device type where it ships one, as dspark-tiny does for
        CPUs, else a synthetic CPU table; `dspark.engine.engine.default_capacity`).

    Returns
    -------
    GenerationOutput (token_ids, text, finish_reason, stats), or a list of them for a batch.
    """
    prompts, batched = encode_prompts(model, prompt)
    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)  # validate once, early
    check_generate_args(model, prompts, max_new_tokens)
    engine = Engine(model, EngineConfig(
        max_running=len(prompts), max_waiting=len(prompts), max_prompt_tokens=max(map(len, prompts)),
        max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk, draft_tokens=draft_tokens,
        drafter=drafter, planner=planner, capacity=capacity))
    seed0 = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    ids = [engine.add_request(p, SamplingParams(temperature, top_p, top_k, seed0 + i), max_new_tokens)
           for i, p in enumerate(prompts)]
    tokens, done = {rid: [] for rid in ids}, {}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
            if event.finished:
                done[event.request_id] = event
    codec = as_text_codec(getattr(model, "tokenizer", None))
    outs = [GenerationOutput(tokens[rid], codec.decode(tokens[rid]) if codec else None,
                             done[rid].finish_reason, done[rid].stats) for rid in ids]
    return outs if batched else outs[0]
