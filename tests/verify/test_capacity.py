"""dspark.verify.capacity: validation, interpolation, extrapolation, JSON round trip."""

import json

import numpy as np
import pytest

from dspark.verify.capacity import CapacityTable, default_cpu_table, shipped_tables


@pytest.mark.parametrize("bt, sps, match", [
    ((), (), "non-empty"),
    ((1, 2), (1.0,), "equal length"),
    ((1, 4, 4), (3.0, 2.0, 1.0), "strictly increasing"),
    ((1, 8, 4), (3.0, 2.0, 1.0), "strictly increasing"),
    ((0, 4), (2.0, 1.0), "batch_tokens"),
    ((1.5, 4), (2.0, 1.0), "ints"),
    ((1, 4), (2.0, 0.0), "steps_per_second"),
    ((1, 4), (2.0, float("nan")), "steps_per_second"),
    ((1, 4), (float("inf"), 1.0), "steps_per_second"),
])
def test_invalid_tables_raise(bt, sps, match):
    with pytest.raises(ValueError, match=match):
        CapacityTable(bt, sps, "x")


def test_label_is_required():
    with pytest.raises(ValueError, match="label"):
        CapacityTable((1, 2), (2.0, 1.0), "")


def test_lookup_interpolates_step_time_and_extrapolates_compute_bound():
    # Probes: 10 ms at B=1, 20 ms at B=11, 40 ms at B=31.
    table = CapacityTable((1, 11, 31), (100.0, 50.0, 25.0), "hand")
    assert table(1) == pytest.approx(100.0)
    assert table(6) == pytest.approx(1 / 0.015)  # halfway in time between 10 ms and 20 ms
    assert table(21) == pytest.approx(1 / 0.030)
    assert table(31) == pytest.approx(25.0)
    assert table(62) == pytest.approx(12.5)  # beyond the last probe: time ∝ B
    assert table.step_time(11) == pytest.approx(0.020)
    values = [table(b) for b in range(1, 80)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone data, monotone curve
    np.testing.assert_allclose(table.many(np.arange(1, 80)), values)
    with pytest.raises(ValueError, match="batch_tokens"):
        table(0)
    with pytest.raises(ValueError, match="batch_tokens"):
        table.many([3, 0])


def test_below_first_probe_uses_the_first_probe():
    table = CapacityTable((4, 8), (10.0, 5.0), "hand")
    assert table(1) == table(3) == table(4) == pytest.approx(10.0)


def test_non_increasing_envelope_of_a_jagged_curve():
    jagged = CapacityTable((1, 2, 3, 4), (10.0, 6.0, 7.0, 5.0), "jagged")
    env = jagged.non_increasing()
    assert env.steps_per_second == (10.0, 7.0, 7.0, 5.0)
    assert env.batch_tokens == jagged.batch_tokens and env.label == jagged.label


def test_from_step_times_takes_the_median():
    table = CapacityTable.from_step_times({8: [0.02, 0.5, 0.021, 0.019, 0.02], 1: [0.01, 0.01, 0.02]}, "probe")
    assert table.batch_tokens == (1, 8)
    assert table.steps_per_second == pytest.approx((100.0, 50.0))
    with pytest.raises(ValueError, match="batch_tokens=4"):
        CapacityTable.from_step_times({4: []}, "probe")


def test_json_round_trip_keeps_label_and_values(tmp_path):
    table = CapacityTable((1, 16, 256), (90.0, 80.5, 20.25), "NVIDIA H200 (TP1, ctx 4096)", "commit abc")
    path = tmp_path / "sps.json"
    table.save(path)
    loaded = CapacityTable.load(path)
    assert loaded == table and loaded(100) == table(100)
    data = json.loads(path.read_text())
    assert data["label"] == "NVIDIA H200 (TP1, ctx 4096)" and data["format"] == "dspark-capacity/1"
    data["batch_tokens"] = [1, 300, 256]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="strictly increasing"):
        CapacityTable.load(path)
    with pytest.raises(ValueError, match="format"):
        CapacityTable.from_dict({"label": "x", "batch_tokens": [1], "steps_per_second": [1.0]})


def test_default_cpu_table_is_labelled_synthetic():
    table = default_cpu_table()
    assert "cpu" in table.label and "not profiled" in table.label
    assert table(1) > table(64) > table(1024) > table(4096) > 0


def test_shipped_tables_load_by_name_and_name_their_gpu():
    names = shipped_tables()
    assert "h200-v4-mini-ctx4k" in names and "h200-v4-mini-ctx32k" in names
    for name in names:
        table = CapacityTable.load(name)
        assert table.label.startswith("NVIDIA H200") and table.conditions["device"] == "NVIDIA H200"
        assert table.conditions["config"] == "v4-mini" and table(1) > table(1024) > 0


def test_unknown_table_names_the_shipped_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="h200-v4-mini-ctx4k"):
        CapacityTable.load(str(tmp_path / "nope.json"))


def test_plain_curve_is_validated_kept_and_falls_back_to_the_entry_at_b(tmp_path):
    """The second curve (plain steps of R requests): looked up like the first, through JSON, the
    envelope and `from_step_times`; without it `plain(R)` is SPS(B = R)."""
    table = CapacityTable((1, 8, 64), (100.0, 90.0, 40.0), "t", plain_requests=(1, 8), plain_steps_per_second=(99.0, 60.0))
    assert table.plain(1) == pytest.approx(99.0) and table.plain(8) == pytest.approx(60.0)
    assert table.plain(4) == pytest.approx(1 / (1 / 99 + 3 / 7 * (1 / 60 - 1 / 99)))  # step time interpolated
    assert table.plain(16) == pytest.approx(60.0 * 8 / 16)  # beyond the last probe: time ∝ R
    assert table(8) == pytest.approx(90.0)  # the width curve is untouched
    bare = CapacityTable((1, 8), (100.0, 90.0), "t")
    assert bare.plain(8) == bare(8) and bare.to_dict().keys() == {"format", "label", "notes", "conditions",
                                                                  "batch_tokens", "steps_per_second"}
    table.save(tmp_path / "t.json")
    assert CapacityTable.load(tmp_path / "t.json") == table
    env = CapacityTable((1, 2, 4), (5.0, 6.0, 4.0), "t", plain_requests=(1, 2), plain_steps_per_second=(3.0, 4.0))
    assert env.non_increasing().plain_steps_per_second == (4.0, 4.0)
    timed = CapacityTable.from_step_times({1: [0.1]}, "t", plain_samples={1: [0.5, 0.2, 0.3], 4: [0.4]})
    assert timed.plain_requests == (1, 4) and timed.plain_steps_per_second == pytest.approx((1 / 0.3, 1 / 0.4))
    with pytest.raises(ValueError, match="plain_requests must be strictly increasing; 2 follows 4"):
        CapacityTable((1,), (1.0,), "t", plain_requests=(4, 2), plain_steps_per_second=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"plain_requests \(1\) and plain_steps_per_second \(0\)"):
        CapacityTable((1,), (1.0,), "t", plain_requests=(4,))
    with pytest.raises(ValueError, match="plain_steps_per_second must be finite and > 0; got -1.0 at plain_requests=2"):
        CapacityTable((1,), (1.0,), "t", plain_requests=(2,), plain_steps_per_second=(-1.0,))
    with pytest.raises(ValueError, match="requests must be >= 1, got 0"):
        table.plain(0)
