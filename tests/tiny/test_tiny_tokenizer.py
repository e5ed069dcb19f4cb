"""Tokenizer: exact round trip, special tokens at 0..3, determinism, transformers loading."""

from __future__ import annotations

import json

import pytest
from tiny_sources import WORDS

from dspark.tiny.tokenizer import (
    BOS,
    EOS,
    NOISE,
    PAD,
    SPECIAL_TOKENS,
    bytes_per_token,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)

TEXTS = [
    "def add(x, y):\n    return x + y\n",
    "class Point:\n    def __init__(self, x):\n        self.x = x\n",
    " ".join(WORDS) + "\n",
    "To be, or not to be: that is the question.\n",
] * 5
UNSEEN = "naïve café — 東京 🙂\n\tif   x:\r\n        pass  # trailing  \n"


def test_round_trip_is_exact_including_unseen_bytes():
    tok = train_tokenizer(TEXTS, vocab_size=320)
    for text in TEXTS[:4] + [UNSEEN, "", " ", "\n\n\n"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert bytes_per_token(tok, TEXTS[:1]) > 1.0  # merges were learned


def test_special_tokens_fixed_ids_atomic_and_skipped():
    tok = train_tokenizer(TEXTS, vocab_size=320)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert special_ids(tok) == {"bos": 0, "eos": 1, "pad": 2, "noise": 3}
    ids = tok.encode(f"{BOS}def{NOISE}{PAD}{EOS}", add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-3:] == [3, 2, 1]
    assert tok.decode(ids, skip_special_tokens=True) == "def"
    assert tok.get_vocab_size() == 320


def test_training_is_deterministic_and_order_free(tmp_path):
    a = train_tokenizer(TEXTS, vocab_size=300)
    b = train_tokenizer(list(reversed(TEXTS)), vocab_size=300)
    assert a.to_str() == b.to_str()


def test_vocab_size_validated():
    with pytest.raises(ValueError, match="vocab_size: 100"):
        train_tokenizer(TEXTS, vocab_size=100)
    with pytest.raises(ValueError, match="min_frequency: 0"):
        train_tokenizer(TEXTS, vocab_size=300, min_frequency=0)


def test_saved_files_load_in_transformers_with_special_tokens(tmp_path):
    from transformers import PreTrainedTokenizerFast

    save_tokenizer(train_tokenizer(TEXTS, vocab_size=320), tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["bos_token"] == BOS
    fast = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (0, 1, 2)
    assert fast.convert_tokens_to_ids(NOISE) == 3 and NOISE in fast.all_special_tokens
    ids = fast.encode(UNSEEN, add_special_tokens=False)
    assert fast.decode(ids, skip_special_tokens=True) == UNSEEN
    assert load_tokenizer(tmp_path).encode(UNSEEN, add_special_tokens=False).ids == ids


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
