"""Argument checks at the edge of `dspark.generate`: every error names the bad argument and value."""

from __future__ import annotations

from dspark.tokenizer import prompt_codec

PLANNERS = ("sync", "async")


def encode_prompts(model, prompt) -> tuple[list[list[int]], bool]:
    """Normalise `prompt` to a list of token-id lists; returns (prompts, was_batch)."""
    if isinstance(prompt, (list, tuple)) and len(prompt) == 0:
        raise ValueError("prompt: empty list")
    batch = isinstance(prompt, (list, tuple)) and not isinstance(prompt[0], int)
    codec = prompt_codec(model)
    vocab = model.config.vocab_size
    out = []
    for i, item in enumerate(prompt if batch else [prompt]):
        if isinstance(item, str):
            if codec is None:
                raise ValueError(f"prompt[{i}]: a string needs a model with a tokenizer; pass token ids")
            item = codec.encode(item)
        if not isinstance(item, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise ValueError(f"prompt[{i}]: expected a string or a list of ints, got {type(item).__name__}")
        if len(item) == 0:
            raise ValueError(f"prompt[{i}]: empty prompt")
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt[{i}]: token id {bad[0]} outside the vocabulary [0, {vocab})")
        out.append(list(item))
    return out, batch


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_draft_tokens(draft_tokens) -> None:
    if draft_tokens != "auto" and (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int)
                                   or draft_tokens < 0):
        raise ValueError(f"draft_tokens must be an int >= 0 or 'auto', got {draft_tokens!r}")


def check_generate_args(model, prompts, max_new_tokens) -> None:
    _positive_int("max_new_tokens", max_new_tokens)
    limit = model.config.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt[{i}]: {len(p)} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                             f"max_position_embeddings={limit}")
