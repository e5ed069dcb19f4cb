"""bench/moe_decode_tma.py --early: its two sides of issue 6's op, on CPU."""

import moe_decode_tma as bench  # bench/ is on pytest's pythonpath

from dspark.kernels import moe_decode


def test_early_sides_withhold_x_ready_and_restore(monkeypatch):
    seen = []
    monkeypatch.setattr(moe_decode, "decode_experts", lambda *a, x_ready=False, **kw: seen.append(x_ready))
    sides = bench.early_sides()
    sides["late"]()
    moe_decode.decode_experts(1, 2, x_ready=True)
    sides["early"]()
    moe_decode.decode_experts(1, 2, x_ready=True)
    assert seen == [False, True]
