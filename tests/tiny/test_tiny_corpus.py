"""Corpus rules, split determinism and disjointness, on the synthetic sources of conftest.py."""

from __future__ import annotations

import json

import pytest

from tiny_sources import make_sources
from dspark.tiny.corpus import (
    MANIFEST,
    Document,
    build_corpus,
    code_documents,
    heldout_units,
    prose_documents,
    read_documents,
    split_documents,
)


def test_code_documents_skip_tests_vendored_and_generated(tmp_path):
    code, _ = make_sources(tmp_path)
    docs = code_documents(code)
    units = [d.unit for d in docs]
    assert units == sorted(units)
    assert "json/decoder.py" in units and "asyncio/tasks.py" in units
    assert not any("SKIPPED" in d.text for d in docs)
    assert all(d.domain == "code" and d.source == f"stdlib:{d.unit}" for d in docs)


def test_prose_documents_globe_only_titles_and_newlines(tmp_path):
    _, prose = make_sources(tmp_path)
    docs = prose_documents(prose)
    assert [d.source for d in docs] == sorted(d.source for d in docs)
    assert {d.unit for d in docs} == {"Hamlet", "King Lear", "The Tempest", "Macbeth", "Othello", "Sonnets"}
    assert not any("folio" in d.text or "\r" in d.text for d in docs)


def test_heldout_units_fixed_count_stable_and_validated():
    units = [f"mod{i}.py" for i in range(100)]
    held = heldout_units("code", units, 0.03)
    assert len(held) == 3 and held <= set(units)
    assert heldout_units("code", reversed(units), 0.03) == held  # order-free: names only
    # A unit's fate depends on its own hash: adding units only moves units at the boundary.
    assert len(held & heldout_units("code", units + ["extra.py"], 0.03)) >= 2
    assert len(heldout_units("prose", ["a", "b", "c"], 0.05)) == 1  # never an empty held-out set
    with pytest.raises(ValueError, match="0.7"):
        heldout_units("code", units, 0.7)
    with pytest.raises(ValueError, match="1 unit"):
        heldout_units("code", ["only.py"], 0.1)


def test_split_is_disjoint_and_complete_by_unit():
    docs = [Document(f"text {i}", "prose", f"s{i}", f"work{i % 7}") for i in range(21)]
    parts = split_documents(docs, 0.2)
    train_units = {d.unit for d in parts["train"]}
    held_units = {d.unit for d in parts["heldout"]}
    assert train_units.isdisjoint(held_units) and held_units
    assert sorted(parts["train"] + parts["heldout"], key=lambda d: d.source) == sorted(docs, key=lambda d: d.source)
    with pytest.raises(ValueError, match="one domain"):
        split_documents(docs + [Document("x", "code", "c", "c")], 0.2)


def test_build_is_byte_identical_across_runs(tmp_path):
    code, prose = make_sources(tmp_path)
    first = build_corpus(tmp_path / "a", code, prose, {"code": 0.2, "prose": 0.2})
    second = build_corpus(tmp_path / "b", code, prose, {"code": 0.2, "prose": 0.2})
    assert {k: v["sha256"] for k, v in first["files"].items()} == {k: v["sha256"] for k, v in second["files"].items()}
    for name in first["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert set(manifest["files"]) == {f"{d}.{s}.jsonl" for d in ("code", "prose") for s in ("train", "heldout")}
    records = [json.loads(line) for line in (tmp_path / "a" / "code.heldout.jsonl").read_text().splitlines()]
    assert records and all(set(r) == {"text", "domain", "source"} and r["domain"] == "code" for r in records)
    held_sources = {r["source"] for r in records}
    train_lines = (tmp_path / "a" / "code.train.jsonl").read_text().splitlines()
    train_sources = {json.loads(line)["source"] for line in train_lines}
    assert held_sources.isdisjoint(train_sources)


def test_read_documents_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="'poetry'"):
        read_documents(tmp_path, "poetry", "train")
    with pytest.raises(FileNotFoundError, match="code.train.jsonl"):
        read_documents(tmp_path, "code", "train")
