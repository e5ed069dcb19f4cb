"""bench/moe_decode_tma.py on CPU: --early's sides of issue 6's op, the --tiles option."""

import json

import pytest

import moe_decode_tma as bench  # bench/ is on pytest's pythonpath

from dspark.kernels import moe, moe_decode, moe_route_decode


def test_early_sides_withhold_x_ready_and_the_early_release(monkeypatch):
    """The "late" side withholds x_ready, the early release and the one launch's counters made before the
    router; "early_wait" only the release; "early_two" the `FUSED` entries."""
    seen = []
    monkeypatch.setattr(moe_decode, "decode_experts", lambda *a, x_ready=False, **kw: seen.append(x_ready))
    assert moe_route_decode.RELEASE_FIRST is True
    monkeypatch.setattr(moe_route_decode, "RELEASE_FIRST", True)  # put back after, whatever the sides leave
    monkeypatch.setattr(moe_decode, "FUSED", dict(moe_decode.FUSED))  # the sides' changes stay in this copy

    def counters(*a):
        return "counters"

    monkeypatch.setattr(moe, "experts_counters", counters)
    fused = dict(moe_decode.FUSED)
    assert fused
    sides = bench.early_sides()
    assert list(sides) == ["early", "late", "early_wait", "early_two"]  # op_ab: new, old, then the rest
    for label in ("late", "early_wait", "early_two", "early"):
        sides[label]()
        moe_decode.decode_experts(1, 2, x_ready=True)
        seen.append((moe_route_decode.RELEASE_FIRST, moe_decode.FUSED == fused, moe.experts_counters(1)))
    assert seen == [False, (False, True, None), True, (False, True, "counters"), True, (True, False, "counters"),
                    True, (True, True, "counters")]


def test_tiles_option_parses_and_names_a_bad_entry():
    assert bench.parse_tiles("16x256x4, 8x512x2") == ((16, 256, 4), (8, 512, 2))
    for bad in ("16x256", "16x256x0", "ax256x4"):
        with pytest.raises(ValueError, match=bad):
            bench.parse_tiles(bad)


def test_up_tile_sides_swap_the_gate_up_tiles_and_put_them_back(monkeypatch):
    from dspark.kernels.moe_decode_tma import TmaTiles

    monkeypatch.setattr(moe_decode, "UP_TMA", moe_decode.UP_TMA)
    monkeypatch.setattr(moe_decode, "FUSED", dict(moe_decode.FUSED))
    shipped, fused = moe_decode.UP_TMA, dict(moe_decode.FUSED)
    key = next(iter(fused))
    new = TmaTiles(8, 512, 4, 3)
    for k in (key, (128, True, False)):  # a `FUSED` cell and a two-launch one
        sides = bench.up_tile_sides(k, new)
        assert list(sides) == ["candidate", "shipped"]
        sides["candidate"]()
        assert moe_decode.UP_TMA == new and moe_decode.decode_tiles(1, k[0]).up_tma == new
        assert moe_decode.FUSED.get(k) == ((new, fused[k][1]) if k in fused else None)
        sides["shipped"]()
        assert moe_decode.UP_TMA == shipped and moe_decode.FUSED == fused


def test_sweep_bests_reads_each_rows_best_tiles(tmp_path):
    from dspark.kernels.moe_decode_tma import TmaTiles

    best = {"n": 8, "k": 512, "warps": 4, "stages": 3, "us": 1.0}
    rows = [{"layer": "v4-flash", "fp8_block": 32, "M": 1, "best": best},
            {"layer": "v4-mini", "fp8_block": None, "M": 8, "best": {**best, "n": 16}}]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"conditions": {}, "results": rows}))
    assert bench.sweep_bests(str(path)) == [("v4-flash", "fp8-32", 1, TmaTiles(8, 512, 4, 3)),
                                            ("v4-mini", "bf16", 8, TmaTiles(16, 512, 4, 3))]
