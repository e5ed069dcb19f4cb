"""bench/l2_flush.py and `attn_batched.graph_timer`'s flush modes, on CPU (the timing itself needs CUDA)."""

import pytest

import attn_batched  # bench/ is on pytest's pythonpath
import l2_flush


def test_graph_timer_names_an_unknown_flush_before_touching_the_gpu():
    assert attn_batched.FLUSHES == ("write", "read")
    with pytest.raises(ValueError, match="'evict'"):
        attn_batched.graph_timer(lambda: None, flush="evict")


def test_timed_runs_every_flush_each_round_in_turn(monkeypatch):
    calls = []
    monkeypatch.setattr(l2_flush, "graph_timer", lambda fn, flush: calls.append(flush) or len(calls) * 1e-6)
    times = l2_flush.timed(lambda: None, rounds=2)
    assert calls == ["write", "read", "write", "read"]
    assert times == {"write": [1e-6, 3e-6], "read": [2e-6, 4e-6]}
    r = l2_flush.rates(4_400, times, copy_bps=2.2e9)
    assert r["write"]["us"] == pytest.approx(2.0) and r["read"]["us"] == pytest.approx(3.0)
    assert r["read"]["pct_hbm"] == pytest.approx(100 * 4_400 / 3e-6 / 4.4e12)
    assert r["write"]["copy_pct"] == pytest.approx(100 * 4_400 / 2e-6 / 2.2e9)
