"""Packing: document framing, row shapes and stride, budgets, the written files and their checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_sources import SEQ_LEN

from dspark.tiny.corpus import read_documents
from dspark.tiny.packing import (
    PACKING_FILE,
    choose_rows,
    load_packed,
    pack_corpus,
    pack_rows,
    spaced_rows,
    token_stream,
)
from dspark.tiny.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer


def test_token_stream_frames_every_document(tiny_data):
    tok = load_tokenizer(tiny_data["tokenizer"])
    texts = read_documents(tiny_data["corpus"], "prose", "heldout")
    stream = token_stream(tok, texts)
    assert stream.dtype == np.uint16
    assert (stream == 0).sum() == len(texts) and (stream == 1).sum() == len(texts)
    starts = np.flatnonzero(stream == 0)
    assert stream[0] == 0 and stream[-1] == 1 and np.all(stream[starts[1:] - 1] == 1)
    assert tok.decode(stream[1:starts[1] - 1 if len(starts) > 1 else -1].tolist()) == texts[0]


def test_pack_rows_shape_and_overlap():
    stream = np.arange(100, dtype=np.uint16)
    rows = pack_rows(stream, 8)
    assert rows.shape == (12, 9)  # (100 − 1) // 8 rows of 8 + 1
    assert np.array_equal(rows[:, -1][:-1], rows[1:, 0])  # the last token of a row starts the next
    assert np.array_equal(rows[:, :-1].reshape(-1), stream[:96])  # every input position once
    assert pack_rows(np.arange(5, dtype=np.uint16), 8).shape == (0, 9)
    with pytest.raises(ValueError, match="seq_len: 1"):
        pack_rows(stream, 1)


def test_row_choices_are_seeded_sorted_and_bounded():
    picked = choose_rows(100, 10, seed=3)
    assert np.array_equal(picked, choose_rows(100, 10, seed=3)) and np.all(np.diff(picked) > 0)
    assert not np.array_equal(picked, choose_rows(100, 10, seed=4))
    assert np.array_equal(choose_rows(5, 10, seed=0), np.arange(5))
    assert list(spaced_rows(11, 3)) == [0, 5, 10]
    assert len(spaced_rows(3, 10)) == 3


def test_packed_files_shapes_and_manifest(tiny_data):
    info = json.loads((tiny_data["packed"] / PACKING_FILE).read_text())
    data = load_packed(tiny_data["packed"], tiny_data["tokenizer"])
    assert data.train.dtype == np.uint16 and data.train.shape[1] == SEQ_LEN + 1 == data.seq_len + 1
    assert set(data.heldout) == {"code", "prose"}
    for rows in data.heldout.values():
        assert rows.shape[1] == SEQ_LEN + 1 and len(rows) > 0
    assert info["files"]["train.npy"]["rows"] == len(data.train)
    assert sum(d["train_rows"] for d in info["domains"].values()) == len(data.train)
    assert int(data.train.max()) < data.vocab_size


def test_train_budget_subsamples_each_domain(tiny_data, tmp_path):
    full = load_packed(tiny_data["packed"])
    info = pack_corpus(tiny_data["corpus"], tiny_data["tokenizer"], tmp_path, seq_len=SEQ_LEN,
                       max_train_tokens=len(full.train) * SEQ_LEN // 2)
    rows = {d: v["train_rows"] for d, v in info["domains"].items()}
    assert 0 < sum(rows.values()) <= len(full.train) // 2 and all(r > 0 for r in rows.values())
    again = pack_corpus(tiny_data["corpus"], tiny_data["tokenizer"], tmp_path / "again", seq_len=SEQ_LEN,
                        max_train_tokens=len(full.train) * SEQ_LEN // 2)
    assert again["files"]["train.npy"]["sha256"] == info["files"]["train.npy"]["sha256"]


def test_load_packed_rejects_another_tokenizer(tiny_data, tmp_path):
    save_tokenizer(train_tokenizer(["something else entirely\n"] * 3, vocab_size=270), tmp_path)
    with pytest.raises(ValueError, match="is not the one"):
        load_packed(tiny_data["packed"], tmp_path)
    with pytest.raises(FileNotFoundError, match=PACKING_FILE):
        load_packed(tmp_path)
