"""Trace schema: write/read round trip, validation naming the bad field, step numbering."""

import math

import numpy as np
import pytest

from dspark.analysis import number_steps, read_traces, to_arrays, validate_record, write_traces


def test_write_read_round_trip(tmp_path, record):
    records = [record("a", accepted=2, confidence=[0.9, 0.8, 0.1], domain="gsm8k"),
               record("b", verified=1, accepted=1, logits=[0.5, -1.0, 2.0], stop=True, committed=1)]
    path = tmp_path / "traces.jsonl"
    assert write_traces(path, records) == 2
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(line.startswith("{") for line in lines)   # header-free JSONL
    assert read_traces(path) == records


def test_read_names_file_and_line(tmp_path, record):
    path = tmp_path / "bad.jsonl"
    good = '{"request_id":"a","position":1,"draft":[1],"confidence":[0.5],"verified":1,"accepted":1,' \
           '"committed":2,"bonus":true,"load":1,"temperature":0.0}'
    path.write_text(good + "\n\n" + good.replace('"accepted":1', '"accepted":2') + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: need 0 <= accepted \(2\) <= verified \(1\)"):
        read_traces(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        read_traces(path)


@pytest.mark.parametrize("change, message", [
    ({"load": 0}, "load must be >= 1"),
    ({"committed": 0}, r"committed \(0\) must lie in \[1, accepted \+ 1 = 1\]"),
    ({"verified": True}, "field 'verified' must be int"),
    ({"confidence": [0.5]}, "confidence has 1 entries for γ=3"),
    ({"confidence_logits": [0.0]}, "confidence_logits has 1 entries"),
    ({"domain": 3}, "field 'domain' must be str"),
])
def test_validate_record_rejects(record, change, message):
    with pytest.raises(ValueError, match=message):
        validate_record({**record(), **change}, "rec")


def test_validate_record_requires_fields(record):
    r = record()
    del r["accepted"]
    with pytest.raises(ValueError, match=r"rec: missing fields \['accepted'\]"):
        validate_record(r, "rec")


def test_number_steps_groups_by_load(record):
    records = [record("a", load=2), record("b", load=2), record("a", load=2), record("b", load=2),
               record("a", load=1)]
    assert [r["step"] for r in number_steps(records)] == [0, 0, 1, 1, 2]
    assert "step" not in records[0]                                  # copies, input untouched
    assert [r["step"] for r in number_steps(records, start=5)][-1] == 7


def test_number_steps_rejects_filtered_traces(record):
    with pytest.raises(ValueError, match="record 0: the next 2 records"):
        number_steps([record("a", load=2), record("b", load=1)])
    with pytest.raises(ValueError, match="record 0: a request appears twice"):
        number_steps([record("a", load=2), record("a", load=2)])


def test_to_arrays_columns(record):
    t = to_arrays([record("a", accepted=1, confidence=[0.9, 0.8, 0.7], domain="x"),
                   record("b", verified=2, accepted=2, logits=[1.0, 2.0, 3.0])])
    assert t.num_rounds == 2 and t.gamma == 3
    assert t.request_id.tolist() == ["a", "b"] and t.domain.tolist() == ["x", ""]
    assert t.accepted.tolist() == [1, 2] and t.committed.tolist() == [2, 3] and t.step.tolist() == [-1, -1]
    assert t.confidence_logits is None                               # not every record has logits
    np.testing.assert_allclose(t.confidence[0], [0.9, 0.8, 0.7])
    sub = t.select(t.domain == "x")
    assert sub.num_rounds == 1 and sub.request_id.tolist() == ["a"]
    with pytest.raises(ValueError, match="mask must be bool"):
        t.select(np.array([1, 0]))


def test_to_arrays_plain_decoding_and_mixed_gamma(record):
    plain = record(gamma=0, verified=0, accepted=0, confidence=[])
    t = to_arrays([plain])
    assert t.gamma == 0 and t.confidence.shape == (1, 0)
    # a plain round in a drafter's trace ("auto"'s budget 0) fits its γ, with no confidences
    mixed = to_arrays([plain, record()])
    assert mixed.gamma == 3 and np.isnan(mixed.confidence[0]).all() and mixed.verified.tolist() == [0, 3]
    with pytest.raises(ValueError, match=r"mix block sizes γ=\[3, 5\]"):
        to_arrays([plain, record(), record(gamma=5, verified=5)])
    assert math.isnan(to_arrays([record(confidence=[])]).confidence[0, 0])
