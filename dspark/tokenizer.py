"""Text ↔ token ids for `generate` and the CLI.

`load_model` attaches either an HF `tokenizers.Tokenizer`, a transformers fast tokenizer, or (for the
random tiny model shipped as `dspark/configs/tiny-v4.json`) a `ByteTokenizer`. `as_text_codec` hides
the difference behind two functions so the generate loop never branches on the tokenizer type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; ids ≥ 256 (bos/eos) are special and decode to nothing.

    Used only by random-weight models whose vocabulary is bytes plus specials: it makes
    `dspark generate "..."` runnable before a trained tokenizer exists.
    """

    vocab_size: int = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TextCodec:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def prompt_codec(model) -> TextCodec | None:
    """The codec of `model`'s tokenizer for prompts: special tokens added when the model asks for them
    (`model.prompt_special_tokens`: transformers targets expect their BOS, as `tokenizer(text)` adds it)."""
    return as_text_codec(getattr(model, "tokenizer", None), getattr(model, "prompt_special_tokens", False))


def as_text_codec(tokenizer, add_special_tokens: bool = False) -> TextCodec | None:
    """Wrap any supported tokenizer object (or None) as an encode/decode pair; `add_special_tokens`
    lets the tokenizer add what its post-processor adds (e.g. BOS) when encoding."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        return TextCodec(tokenizer.encode, tokenizer.decode)
    # tokenizers.Tokenizer: encode() returns an Encoding; transformers tokenizers return a list.
    def encode(text: str) -> list[int]:
        enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return TextCodec(encode, decode)
