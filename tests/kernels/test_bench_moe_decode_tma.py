"""bench/moe_decode_tma.py on CPU: --early's sides of issue 6's op, the --tiles option."""

import pytest

import moe_decode_tma as bench  # bench/ is on pytest's pythonpath

from dspark.kernels import moe_decode, moe_route_decode


def test_early_sides_withhold_x_ready_and_the_early_release(monkeypatch):
    seen = []
    monkeypatch.setattr(moe_decode, "decode_experts", lambda *a, x_ready=False, **kw: seen.append(x_ready))
    assert moe_route_decode.RELEASE_FIRST is True
    monkeypatch.setattr(moe_route_decode, "RELEASE_FIRST", True)  # put back after, whatever the sides leave
    monkeypatch.setattr(moe_decode, "FUSED", dict(moe_decode.FUSED))  # the sides' changes stay in this copy
    fused = dict(moe_decode.FUSED)
    assert fused
    sides = bench.early_sides()
    assert list(sides) == ["early", "late", "early_wait", "early_two"]  # op_ab: new, old, then the rest
    for label in ("late", "early_wait", "early_two", "early"):
        sides[label]()
        moe_decode.decode_experts(1, 2, x_ready=True)
        seen.append((moe_route_decode.RELEASE_FIRST, moe_decode.FUSED == fused))
    assert seen == [False, (False, True), True, (False, True), True, (True, False), True, (True, True)]


def test_tiles_option_parses_and_names_a_bad_entry():
    assert bench.parse_tiles("16x256x4, 8x512x2") == ((16, 256, 4), (8, 512, 2))
    for bad in ("16x256", "16x256x0", "ax256x4"):
        with pytest.raises(ValueError, match=bad):
            bench.parse_tiles(bad)
