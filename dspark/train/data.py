"""Training sequences for `dspark train-draft`: reading, writing and regenerating them.

A training sequence is token ids plus a loss mask (1 on response tokens, dspark spec §5.1): anchors
and labels are drawn only where the mask is 1. Three JSONL record forms are read, one object a line:

    {"input_ids": [..], "loss_mask": [..]}      loss_mask optional (default: all ones)
    {"text": "..."}                               tokenised with the model's tokenizer, all ones
    {"prompt": .., "completion": ..}              text or ids each; mask 0 on the prompt, 1 after

The paper regenerates the responses with the target itself (spec §5.1), so the draft learns the
target's own continuations; `self_distill` does that with `dspark.generate`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dspark.generate import generate
from dspark.tokenizer import as_text_codec


@dataclass(frozen=True)
class TrainingSequence:
    """input_ids [L] and loss_mask [L] (0/1), as tuples."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __post_init__(self):
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.input_ids)} input_ids")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")

    def truncated(self, max_length: int) -> TrainingSequence:
        return TrainingSequence(self.input_ids[:max_length], self.loss_mask[:max_length])


def _ids(value, codec, where: str) -> list[int]:
    if isinstance(value, str):
        if codec is None:
            raise ValueError(f"{where}: text needs a model with a tokenizer; give token ids")
        return codec.encode(value)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{where}: expected a string or a list of token ids")
    return value


def parse_record(record: dict, codec=None, where: str = "record") -> TrainingSequence:
    """One JSONL object (module docstring) -> TrainingSequence."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "input_ids" in record:
        ids = _ids(record["input_ids"], None, f"{where}.input_ids")
        return TrainingSequence(tuple(ids), tuple(record.get("loss_mask", [1] * len(ids))))
    if "text" in record:
        ids = _ids(record["text"], codec, f"{where}.text")
        return TrainingSequence(tuple(ids), (1,) * len(ids))
    if "prompt" in record and ("completion" in record or "response" in record):
        prompt = _ids(record["prompt"], codec, f"{where}.prompt")
        completion = _ids(record.get("completion", record.get("response")), codec, f"{where}.completion")
        return TrainingSequence(tuple(prompt + completion), (0,) * len(prompt) + (1,) * len(completion))
    raise ValueError(f"{where}: needs 'input_ids', 'text', or 'prompt' + 'completion'")


def read_jsonl(path: str | Path, tokenizer=None, vocab_size: int | None = None) -> list[TrainingSequence]:
    """All records of a JSONL file; `tokenizer` (any `dspark.tokenizer` kind) for text records.

    Raises ValueError naming the line of a bad record or of a token id outside [0, vocab_size).
    """
    codec = as_text_codec(tokenizer)
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            seq = parse_record(json.loads(line), codec, f"{path}:{i}")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in seq.input_ids):
                raise ValueError(f"{path}:{i}: token id outside the vocabulary [0, {vocab_size})")
            out.append(seq)
    return out


def write_jsonl(sequences: Iterable[TrainingSequence], path: str | Path) -> None:
    with open(path, "w") as f:
        for seq in sequences:
            f.write(json.dumps({"input_ids": list(seq.input_ids), "loss_mask": list(seq.loss_mask)}) + "\n")


def self_distill(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> list[TrainingSequence]:
    """Prompt + the target's own continuation, masked to the continuation (spec §5.1)."""
    outs = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    return [TrainingSequence(tuple(p) + tuple(o.token_ids), (0,) * len(p) + (1,) * len(o.token_ids))
            for p, o in zip(prompts, outs)]
