"""bench/moe_op_profile.py: the trace parsing (replays split on the flush, per-position medians) and the
table sides it profiles, on CPU."""

import moe_op_profile as mp  # bench/ is on pytest's pythonpath


def _kernel(name, ts, dur, cat="kernel"):
    return {"cat": cat, "ph": "X", "name": name, "ts": ts, "dur": dur}


def _trace():
    events = [{"cat": "cpu_op", "ph": "X", "name": "aten::bitwise_not", "ts": 0.0, "dur": 5.0}]  # not device work
    for start, up in ((100.0, 20.0), (300.0, 22.0), (500.0, 21.0)):
        events += [_kernel("void at::native::bitwise_not_kernel", start, 50.0),
                   _kernel("_route_kernel", start + 52.0, 3.0),
                   _kernel("Memset (Device)", start + 56.0, 1.0, cat="gpu_memset"),
                   _kernel("_decode_up_kernel", start + 60.0, up),
                   _kernel("_decode_down_kernel", start + 60.0 + up + 2.0, 10.0)]
    events.append(_kernel("_warm_kernel", 10.0, 3.0))  # before the first flush: not part of a replay
    return {"traceEvents": events[::-1]}  # out of order: activities sorts by start


def test_replays_split_on_the_flush_and_keep_kernels_and_memsets():
    runs = mp.replays(mp.activities(_trace()))
    assert len(runs) == 3
    assert [r["name"] for r in runs[0]] == ["_route_kernel", "Memset (Device)", "_decode_up_kernel",
                                           "_decode_down_kernel"]
    assert runs[0][-1]["name"] == "_decode_down_kernel" and runs[2][-1]["ts"] == 500.0 + 60.0 + 21.0 + 2.0


def test_summary_medians_per_position():
    s = mp.summarize(mp.replays(mp.activities(_trace())))
    assert s["replays"] == 3
    assert [st["dur_us"] for st in s["steps"]] == [3.0, 1.0, 21.0, 10.0]
    assert [st["gap_before_us"] for st in s["steps"]] == [0.0, 1.0, 3.0, 2.0]
    assert s["busy_us"] == 35.0
    assert s["span_us"] == 3.0 + 1.0 + 1.0 + 3.0 + 21.0 + 2.0 + 10.0


def test_summary_keeps_the_common_replay_length():
    runs = mp.replays(mp.activities(_trace()))
    runs.append(runs[0][:2])  # a replay the trace cut short
    assert mp.summarize(runs)["replays"] == 3


def test_sides_take_the_tma_entries_out_and_restore_them():
    from dspark.kernels import moe_decode as md

    up, down, fused = md.UP_TMA, dict(md.DOWN_TMA), dict(md.FUSED)
    assert up is not None and down and fused  # else the gemv side would profile the shipped op
    put = mp.sides()
    try:
        put["gemv"]()
        assert md.UP_TMA is None and not md.DOWN_TMA and not md.FUSED
    finally:
        put["shipped"]()
    assert md.UP_TMA == up and md.DOWN_TMA == down and md.FUSED == fused
