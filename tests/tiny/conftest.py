"""The tiny corpus, tokenizer and packed rows built once per session from the synthetic sources."""

from __future__ import annotations

import pytest
from tiny_sources import SEQ_LEN, TOKENIZER_VOCAB, make_sources

from dspark.tiny.corpus import DOMAINS, build_corpus, read_documents
from dspark.tiny.packing import pack_corpus
from dspark.tiny.tokenizer import save_tokenizer, train_tokenizer


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """{"corpus", "tokenizer", "packed"} directories built from the synthetic sources."""
    root = tmp_path_factory.mktemp("tiny")
    code, prose = make_sources(root)
    corpus, tokenizer, packed = root / "corpus", root / "tokenizer", root / "packed"
    build_corpus(corpus, code, prose, {"code": 0.2, "prose": 0.2})
    texts = [t for d in DOMAINS for t in read_documents(corpus, d, "train")]
    save_tokenizer(train_tokenizer(texts, TOKENIZER_VOCAB), tokenizer)
    pack_corpus(corpus, tokenizer, packed, seq_len=SEQ_LEN)
    return {"root": root, "code": code, "prose": prose, "corpus": corpus, "tokenizer": tokenizer, "packed": packed}
