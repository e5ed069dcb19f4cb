"""The decode MoE's gate/up launch through TMA (dspark/kernels/moe_decode_tma.py).

On CPU the kernel runs in the Triton interpreter (tests/kernels/conftest.py): D = 96, I = 80 (routed),
48 (shared) are off every tile and step, so the descriptors' out-of-bounds tiles (zero-filled) and the
stores' masks are reached; FP8 with 32×32 blocks at steps inside one block and over several.
"""

import pytest
import torch

from dspark.kernels import moe, moe_decode, moe_decode_tma, triton_available
from dspark.kernels.moe_decode_tma import TmaTiles
from test_moe import TOL, _expert_case, _off_tile_experts, expert_weights, rel_err  # noqa: E402 (on sys.path)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")

ROUTED, SHARED = 80, 48  # _off_tile_experts' I and I_s


@pytest.mark.parametrize("tiles", [(16, 16, 4, 2), (16, 64, 4, 3), (32, 32, 4, 5)])
@pytest.mark.parametrize("fp8_block", [None, 32])
@pytest.mark.parametrize("n_tok", [1, 2])
def test_tma_up_rows_are_the_gemv_kernels_rows(tiles, fp8_block, n_tok, poisoned):
    """h as `moe_decode.decode_up`'s GEMV kernel lays it out (routed rows, then the shared rows), to fp32
    rounding, so the down kernel reads either; the experts then match the reference."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(n_tok, fp8_block, seed=21)
    n_assign = ids.numel()
    with poisoned():
        h, args = moe_decode_tma.tma_up(x, ids, w1, w3, s1, s3, 10.0, TmaTiles(*tiles))
    h_ref, args_ref = moe_decode.decode_up(x, ids, w1, w3, s1, s3, 10.0)  # DecodeTiles(): the GEMV kernel
    assert h.shape == h_ref.shape and args == args_ref
    assert rel_err(h[:n_assign], h_ref[:n_assign]) < TOL[torch.float32]
    assert rel_err(h[n_assign:, :SHARED], h_ref[n_assign:, :SHARED]) < TOL[torch.float32]
    y = moe_decode.decode_down(h, x, weights, ids, w2, s2, args)
    assert rel_err(y, moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)) \
        < TOL[torch.float32]


@pytest.mark.parametrize("split", [2, 4])
def test_tma_up_zeroes_the_split_down_kernels_tickets(split, poisoned):
    """With the down kernel split over programs, the TMA launch zeroes its ticket counters as the GEMV
    launch does: the experts match the reference, twice on the same counters."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(2, 32, seed=4)
    tiles = moe_decode.DecodeTiles(down_n=16, down_k=64, down_split=split, up_tma=TmaTiles(16, 64, 4, 3))
    ref = moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)
    with poisoned():
        h, args = moe_decode.decode_up(x, ids, w1, w3, s1, s3, 10.0, tiles)
    assert args[-1].shape == (2, 8) and not args[-1].any()  # ⌈96 / 16⌉ = 6 counters, padded to 8
    y = moe_decode.decode_down(h, x, weights, ids, w2, s2, args, tiles)
    assert rel_err(y, ref) < TOL[torch.float32]
    assert torch.equal(moe_decode.decode_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, tiles=tiles), y)


@pytest.mark.parametrize("fp8_block", [None, 32])
def test_tma_up_early_is_the_same_launch_reordered(fp8_block, poisoned, monkeypatch):
    """`early` (the shared rows' programs first, then the routed ones, each part row block by row block, in
    one 1-D grid; on the GPU the shared ones load before the PDL wait): the same h bit for bit, so every
    (work row, row block) is computed once, and the split down kernel's tickets still zeroed."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(2, fp8_block, seed=13)
    tiles = TmaTiles(16, 32, 4, 3)
    grids, launcher = [], moe_decode_tma._tma_up_kernel

    class Recorded:
        def __getitem__(self, grid):
            grids.append(grid)
            return launcher[grid]

    monkeypatch.setattr(moe_decode_tma, "_tma_up_kernel", Recorded())
    with poisoned():
        h, args = moe_decode_tma.tma_up(x, ids, w1, w3, s1, s3, 10.0, tiles, tickets=8, early=True)
    h_ref, args_ref = moe_decode_tma.tma_up(x, ids, w1, w3, s1, s3, 10.0, tiles, tickets=8)
    rows, blocks = ids.numel() + 2, -(-h.shape[1] // tiles.n)
    assert grids == [(rows * blocks,), (rows, blocks)]
    n_assign = ids.numel()
    assert torch.equal(h[:n_assign], h_ref[:n_assign])
    assert torch.equal(h[n_assign:, :SHARED], h_ref[n_assign:, :SHARED])
    assert args[-1].shape == (2, 8) and not args[-1].any()


def test_fused_moe_promises_x_is_ready_and_moe_experts_does_not(monkeypatch):
    """`fused_moe` launches the router after x exists, so its experts may start the shared rows early
    (`x_ready`); `moe_experts` alone cannot know what its caller launched last; a non-contiguous x (copied
    right before the experts) never is."""
    seen = []
    original = moe_decode.decode_experts

    def record(*args, x_ready=False, **kw):
        seen.append(x_ready)
        return original(*args, x_ready=x_ready, **kw)

    monkeypatch.setattr(moe_decode, "decode_experts", record)
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(1, None, seed=3)
    gate = (torch.randn(w1.shape[0], x.shape[1], generator=torch.Generator().manual_seed(1)) / 4).to(x.device)
    bias = torch.zeros(w1.shape[0], device=x.device)
    route = dict(top_k=ids.shape[1], routed_scaling_factor=1.5, hash_routing=False)
    y = moe.fused_moe(x, gate, bias, None, None, w1, w2, w3, s1, s2, s3, **route, swiglu_limit=10.0)
    assert rel_err(y, moe.fused_moe_ref(x, gate, bias, None, None, w1, w2, w3, s1, s2, s3, **route,
                                        swiglu_limit=10.0)) < TOL[torch.float32]
    moe.moe_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)
    wide = torch.cat((x, x), dim=1)[:, ::2]  # x's values, not contiguous
    moe.fused_moe(wide, gate, bias, None, None, w1, w2, w3, s1, s2, s3, **route, swiglu_limit=10.0)
    assert seen == [True, False, False]


def test_decode_experts_starts_early_at_one_token_only(monkeypatch):
    """`x_ready` reaches the TMA gate/up launch as `early` at one token (`EARLY_MAX_TOKENS`), where it won; at
    2 tokens the launch is the usual one; without the promise never."""
    seen = []
    original = moe_decode_tma.launch_up

    def record(*args):
        seen.append(args[-1])
        return original(*args)

    monkeypatch.setattr(moe_decode_tma, "launch_up", record)
    assert moe_decode.EARLY_MAX_TOKENS == 1
    args = _off_tile_experts(2, None, seed=6)
    one = (args[0][:1], args[1][:1], args[2][:1], *args[3:])
    tiles = moe_decode.DecodeTiles(up_tma=TmaTiles(16, 32, 4, 3))
    y1 = moe_decode.decode_experts(*one, 10.0, tiles=tiles, x_ready=True)
    moe_decode.decode_experts(*args, 10.0, tiles=tiles, x_ready=True)
    assert torch.equal(moe_decode.decode_experts(*one, 10.0, tiles=tiles), y1)
    assert seen == [True, False, False]


def test_the_model_moe_promises_x_ready_to_its_experts(monkeypatch):
    """A V4 model's fused MoE layer routes x, then calls its experts op with `x_ready` (the routing's launches
    came last) and the counters it made before the routing (`moe.experts_counters`), and gives the reference
    experts of its own routing."""
    import json
    from importlib import resources

    from dspark.api import init_model
    from dspark.kernels import KernelConfig

    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    kernels = KernelConfig(moe_route="triton", fused_moe="triton", moe_experts="triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = init_model(config, device=device, kernels=kernels).layers[-1].ffn
    seen = []
    op = layer._experts_op
    layer._experts_op = lambda *a, **kw: seen.append((kw.get("x_ready"), "counters" in kw)) or op(*a, **kw)
    x = torch.randn(2, config["hidden_size"], device=device).to(layer.shared_experts.w1.weight.dtype)
    ids = torch.randint(0, config["vocab_size"], (2,), device=device)
    with torch.no_grad():
        out = layer(x, ids)
        weights, experts = layer._routing(x, ids)
        s = layer.shared_experts
        want = moe.moe_experts_ref(x, weights, experts, *layer.stacked_weights(), s.w1.weight, s.w2.weight,
                                   s.w3.weight, swiglu_limit=layer.swiglu_limit, x_ready=True)
    assert seen == [(True, True)] and rel_err(out, want) < TOL[x.dtype]


def _count_launches(monkeypatch, launch="up"):
    """Counts of the TMA and GEMV kernels' launches of the gate/up (`launch` "up") or the down launch, or of
    the one-launch experts ("fused": "tma" only)."""
    launches = {"tma": 0, "gemv": 0}
    kernels = [("tma", moe_decode_tma, f"_tma_{launch}_kernel")]
    if launch != "fused":
        kernels.append(("gemv", moe_decode, f"_decode_{launch}_kernel"))
    for name, module, kernel in kernels:
        original = getattr(module, kernel)

        def counted(grid, name=name, original=original):
            launches[name] += 1
            return original[grid]

        monkeypatch.setattr(module, kernel, type("Count", (), {"__getitem__": lambda self, grid, c=counted: c(grid)})())
    return launches


@pytest.mark.parametrize("fp8_block", [None, 32, 128])
def test_the_tables_take_the_tma_launch_where_it_runs(fp8_block, monkeypatch):
    """`decode_tiles` carries `UP_TMA` (but for the two table entries where the GEMV kernel won), so the
    default decode path's gate/up launch is the TMA kernel (here: the interpreter); weights whose rows
    are not 16-byte aligned (FP8 rows of 72 bytes) take the GEMV kernel; `UP_TMA` None takes it
    everywhere. Each computes the same experts."""
    assert moe_decode.decode_tiles(1, fp8_block, 96).up_tma == moe_decode.UP_TMA == TmaTiles(16, 256, 4, 5)
    assert moe_decode.decode_tiles(1, None, 4096).up_tma is moe_decode.decode_tiles(8, 128, 2048).up_tma is None
    assert moe_decode.decode_tiles(8, None, 4096).up_tma == moe_decode.decode_tiles(1, 128, 2048).up_tma
    launches = _count_launches(monkeypatch)
    args = _off_tile_experts(1, fp8_block, seed=8)
    y = moe_decode.decode_experts(*args, 10.0)
    assert launches == {"tma": 1, "gemv": 0}
    assert rel_err(y, moe.moe_experts_ref(*args, swiglu_limit=10.0)) < TOL[torch.float32]
    monkeypatch.setattr(moe_decode, "UP_TMA", None)
    assert rel_err(moe_decode.decode_experts(*args, 10.0), y) < TOL[torch.float32]
    assert launches == {"tma": 1, "gemv": 1}
    if fp8_block:
        monkeypatch.setattr(moe_decode, "UP_TMA", TmaTiles())
        w1, w2, w3, s1, s2, s3 = expert_weights(8, 72, ROUTED, torch.float32, seed=1, fp8_block=fp8_block)
        x = args[0][:, :72].contiguous()
        assert not moe_decode_tma.supported(x, w1, w3, s1, s3)
        moe_decode.decode_experts(x, *args[1:3], w1, w2, w3, s1, s2, s3, 10.0)
        assert launches == {"tma": 1, "gemv": 2}


def test_tma_tiles_are_checked():
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(1, 32, seed=0)
    with pytest.raises(ValueError, match="rows 64 must divide the FP8 block 32"):
        moe_decode_tma.tma_up(x, ids, w1, w3, s1, s3, 10.0, TmaTiles(n=64))
    with pytest.raises(ValueError, match="powers of two .* got 16, 48"):
        moe_decode_tma.tma_up(x, ids, w1, w3, s1, s3, 10.0, TmaTiles(k=48))


@pytest.mark.parametrize("tiles,split", [((16, 16, 4, 2), 1), ((16, 64, 4, 3), 2), ((32, 32, 4, 5), 3), ((16, 32, 4, 3), 4)])
@pytest.mark.parametrize("fp8_block", [None, 32])
def test_tma_down_is_the_gemv_down_kernel(tiles, split, fp8_block, poisoned):
    """`tma_down` over the K + 1 = 4 expert slots split over 1–4
    programs per row block (uneven shares at 3), the last program to take its ticket adding the fp32
    parts: the GEMV down kernel's y to fp32 rounding; again on the same counters, the same bits."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(2, fp8_block, seed=13)
    gemv = moe_decode.DecodeTiles(down_n=tiles[0], down_split=split)
    with poisoned():
        h, args = moe_decode.decode_up(x, ids, w1, w3, s1, s3, 10.0, gemv)
        y = moe_decode_tma.tma_down(h, x, weights, ids, w2, s2, args, TmaTiles(*tiles), split)
    assert rel_err(y, moe_decode.decode_down(h, x, weights, ids, w2, s2, args, gemv)) < TOL[torch.float32]
    assert rel_err(y, moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)) \
        < TOL[torch.float32]
    assert args[-1] is None or not args[-1].any()
    assert torch.equal(moe_decode_tma.tma_down(h, x, weights, ids, w2, s2, args, TmaTiles(*tiles), split), y)


def test_tma_down_checks_its_split():
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(1, None, seed=0)
    h, args = moe_decode.decode_up(x, ids, w1, w3, s1, s3, 10.0)
    for split in (0, 5, 2.0):
        with pytest.raises(ValueError, match=f"split must be an int in 1..4 .*got {split!r}"):
            moe_decode_tma.tma_down(h, x, weights, ids, w2, s2, args, TmaTiles(), split)
    with pytest.raises(ValueError, match="needs the up launch's tickets for 6 row blocks"):
        moe_decode_tma.tma_down(h, x, weights, ids, w2, s2, args, TmaTiles(), 2)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fp8_block", [None, 32])
def test_down_tma_tiles_take_the_tma_down_launch_where_it_runs(split, fp8_block, monkeypatch, poisoned):
    """`DecodeTiles.down_tma` sends the down launch to `tma_down` (its slots over `down_split` programs, the
    up launch's counters sized for its row blocks, finer than `down_n` here): the experts match the reference
    and the GEMV-only tiles' result; weights whose rows are not 16-byte aligned take the GEMV down kernel."""
    launches = _count_launches(monkeypatch, "down")
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(2, fp8_block, seed=17)
    gemv = moe_decode.DecodeTiles(down_n=32, down_split=split)
    tiles = gemv._replace(down_tma=TmaTiles(16, 32, 4, 3))
    with poisoned():
        y = moe_decode.decode_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, tiles=tiles)
    assert launches == {"tma": 1, "gemv": 0}
    ref = moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)
    assert rel_err(y, ref) < TOL[torch.float32]
    assert rel_err(y, moe_decode.decode_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, tiles=gemv)) \
        < TOL[torch.float32]
    assert launches == {"tma": 1, "gemv": 1}
    if fp8_block:
        w1, w2, w3, s1, s2, s3 = expert_weights(8, 96, 72, torch.float32, seed=1, fp8_block=fp8_block)
        assert not moe_decode_tma.supported(x, w2, s2)  # W2's rows: I = 72 bytes
        y = moe_decode.decode_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, tiles=tiles)
        assert launches == {"tma": 1, "gemv": 2}
        assert rel_err(y, moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)) \
            < TOL[torch.float32]


def test_down_tma_table_entries_reach_decode_tiles(monkeypatch):
    """A `DOWN_TMA` entry gives its table key's tiles the TMA down launch and its split (clamped to a narrower
    top-k's K + 1 slots); other keys keep the GEMV down kernel."""
    key = moe_decode.table_key(1, 128, 4096)
    assert key == (128, True, False) and moe_decode.table_key(8, 32, 2048) == (32, False, True)
    monkeypatch.setattr(moe_decode, "DOWN_TMA", {key: (TmaTiles(16, 512, 8, 4), 7)})
    tiles = moe_decode.decode_tiles(1, 128, 4096)
    assert tiles.down_tma == TmaTiles(16, 512, 8, 4) and tiles.down_split == 7
    assert moe_decode.decode_tiles(1, 128, 4096, top_k=2).down_split == 3
    assert moe_decode.decode_tiles(8, 128, 4096).down_tma is None


def test_the_tables_take_the_tma_down_launch_for_dense_weights_at_several_tokens(monkeypatch):
    """The shipped `DOWN_TMA`: dense weights at 8 tokens (both widths) take the TMA down launch, unsplit; one
    token and FP8 weights keep the GEMV down kernel. The default path at 2 tokens runs it and computes the
    reference's experts."""
    for dim in (4096, 2048):
        assert moe_decode.decode_tiles(8, None, dim).down_tma == TmaTiles(8, 512, 4, 4)
        assert moe_decode.decode_tiles(8, None, dim).down_split == 1
        assert moe_decode.decode_tiles(1, None, dim).down_tma is None
        assert all(moe_decode.decode_tiles(m, b, dim).down_tma is None for m in (1, 8) for b in (32, 128))
    launches = _count_launches(monkeypatch, "down")
    args = _off_tile_experts(2, None, seed=6)
    y = moe_decode.decode_experts(*args, 10.0)
    assert launches == {"tma": 1, "gemv": 0}
    assert rel_err(y, moe.moe_experts_ref(*args, swiglu_limit=10.0)) < TOL[torch.float32]


@pytest.mark.parametrize("up,down", [((16, 16, 4, 2), (16, 16, 4, 2)), ((32, 32, 4, 3), (16, 64, 4, 3))])
@pytest.mark.parametrize("fp8_block", [None, 32])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_tma_fused_is_the_two_launches(up, down, fp8_block, n_tok, poisoned):
    """The experts as one launch (gate/up items, then down items that wait for their row's h and add their
    slot through the tickets): the two launches' y to fp32 rounding, the reference's; twice, the same bits."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(n_tok, fp8_block, seed=23)
    with poisoned():
        y = moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, TmaTiles(*up), TmaTiles(*down))
    assert rel_err(y, moe_decode.decode_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0)) < TOL[torch.float32]
    assert rel_err(y, moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)) \
        < TOL[torch.float32]
    assert torch.equal(moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, TmaTiles(*up),
                                                TmaTiles(*down)), y)


@pytest.mark.parametrize("fp8_block", [None, 32])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_tma_fused_early_is_the_same_launch_reordered(fp8_block, n_tok, poisoned):
    """Given counters made beforehand (`fused_counters`), the one launch's EARLY form (the shared rows' items
    first; on the GPU their gate/up items load before the PDL wait): the same y bit for bit as without,
    and the counters used (so the launch counted its items in them, not in a buffer of its own)."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(n_tok, fp8_block, seed=27)
    up, down = TmaTiles(16, 32, 4, 3), TmaTiles(16, 64, 4, 2)
    counters = moe_decode_tma.fused_counters(x, ids.shape[1], down)
    n_rows, blocks = n_tok * (ids.shape[1] + 1), -(-x.shape[1] // down.n)
    assert counters.dtype == torch.int32 and counters.shape == (1 + n_rows + n_tok * blocks,)
    assert not counters.any()
    with poisoned():
        y = moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, up, down, counters=counters)
    up_items = n_rows * -(-max(ROUTED, SHARED) // up.n)
    assert counters[0] == up_items + n_rows * blocks  # every item taken once
    assert torch.equal(counters[1:1 + n_rows], torch.full((n_rows,), up_items // n_rows, dtype=torch.int32,
                                                          device=x.device))
    assert not counters[1 + n_rows:].any()  # the tickets put back to 0
    assert torch.equal(moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, up, down), y)


def test_tma_fused_checks_its_counters():
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(1, 32, seed=0)
    down = TmaTiles(16, 256, 4, 4)
    top_k = ids.shape[1]  # 3: the item counter, 4 rows' done counts, ⌈96 / 16⌉ tickets = 11 counters
    wrong = moe_decode_tma.fused_counters(x, top_k + 1, down)
    with pytest.raises(ValueError, match=rf"counters must be fused_counters\(x, 3, down\): int32 \[11\] on "
                                         rf"{x.device}, got torch.int32 \[12\]"):
        moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, down=down, counters=wrong)
    with pytest.raises(ValueError, match="got torch.int64"):
        moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0, down=down,
                                 counters=moe_decode_tma.fused_counters(x, top_k, down).long())


def test_fused_counters_only_where_the_one_launch_may_start_early(monkeypatch):
    """`moe_decode.fused_counters`: zeroed counters for the decode call's one launch (`FUSED`) at up to
    `EARLY_MAX_TOKENS` tokens, None elsewhere; `decode_experts` takes them only with `x_ready` (and so
    `moe.experts_counters` past the decode path's size gives None)."""
    fused = (TmaTiles(16, 32, 4, 3), TmaTiles(16, 64, 4, 2))
    monkeypatch.setattr(moe_decode, "FUSED", {moe_decode.table_key(1, 32, 96): fused})
    args = _off_tile_experts(2, 32, seed=9)
    x, weights, ids, w = args[0], args[1], args[2], args[3:]
    top_k = ids.shape[1]  # 3
    counters = moe_decode.fused_counters(x[:1], *w, top_k)
    assert counters.shape == (1 + 4 + 6,) and not counters.any()  # the item, 4 rows' counts, ⌈96 / 16⌉ tickets
    assert moe_decode.fused_counters(x, *w, top_k) is None  # 2 tokens: two launches
    assert moe_decode.fused_counters(x[:1], *_off_tile_experts(1, None, seed=9)[3:], top_k) is None  # no entry
    assert moe.experts_counters(x[:1], *w, top_k).shape == counters.shape
    assert moe.experts_counters(x[:1], *w, 65) is None  # 65 assignments: the packed path
    seen = []
    original = moe_decode_tma.tma_fused
    monkeypatch.setattr(moe_decode_tma, "tma_fused",
                        lambda *a, counters=None, **kw: seen.append(counters) or original(*a, counters=counters, **kw))
    one = (x[:1], weights[:1], ids[:1], *w)
    y = moe_decode.decode_experts(*one, 10.0, x_ready=True, counters=counters)
    assert torch.equal(moe_decode.decode_experts(*one, 10.0, counters=moe_decode.fused_counters(x[:1], *w, top_k)), y)
    assert seen[0] is counters and seen[1] is None
    assert rel_err(y, moe.moe_experts_ref(*one, swiglu_limit=10.0)) < TOL[torch.float32]


def test_fused_moe_zeroes_the_counters_before_its_router(monkeypatch):
    """`fused_moe` makes the one launch's counters before the router's launches (so no memset sits between
    the router and the experts) and hands them to its experts with `x_ready`."""
    fused = (TmaTiles(16, 32, 4, 3), TmaTiles(16, 64, 4, 2))
    monkeypatch.setattr(moe_decode, "FUSED", {moe_decode.table_key(1, 32, 96): fused})
    order, got = [], {}
    make, route, experts = moe.experts_counters, moe.moe_route, moe.moe_experts
    monkeypatch.setattr(moe, "experts_counters", lambda *a: order.append("counters") or make(*a))
    monkeypatch.setattr(moe, "moe_route", lambda *a, **kw: order.append("route") or route(*a, **kw))
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **kw: got.update(kw) or experts(*a, **kw))
    x, _, _, w1, w2, w3, s1, s2, s3 = _off_tile_experts(1, 32, seed=3)
    gate = (torch.randn(w1.shape[0], x.shape[1], generator=torch.Generator().manual_seed(1)) / 4).to(x.device)
    bias = torch.zeros(w1.shape[0], device=x.device)
    route_args = dict(top_k=3, routed_scaling_factor=1.5, hash_routing=False)
    y = moe.fused_moe(x, gate, bias, None, None, w1, w2, w3, s1, s2, s3, **route_args, swiglu_limit=10.0)
    assert order == ["counters", "route"] and got["x_ready"] and got["counters"] is not None
    assert rel_err(y, moe.fused_moe_ref(x, gate, bias, None, None, w1, w2, w3, s1, s2, s3, **route_args,
                                        swiglu_limit=10.0)) < TOL[torch.float32]


def test_tma_fused_checks_its_tiles():
    args = _off_tile_experts(1, 32, seed=0)
    with pytest.raises(ValueError, match="rows 64 must divide the FP8 block 32"):
        moe_decode_tma.tma_fused(*args, 10.0, down=TmaTiles(n=64))
    with pytest.raises(ValueError, match="powers of two .* got 16, 48"):
        moe_decode_tma.tma_fused(*args, 10.0, up=TmaTiles(k=48))


def test_the_tables_take_the_one_launch_experts_where_they_won(monkeypatch):
    """The shipped `FUSED`: one token on V4-Flash widths, FP8 (32×32, 128×128) and dense weights; elsewhere two
    launches.
    A `FUSED` entry sends `decode_experts` to `tma_fused` (one launch, the reference's experts); weights whose
    rows are not 16-byte aligned take the two launches."""
    assert moe_decode.decode_tiles(1, 32, 4096).fused == (TmaTiles(16, 256, 4, 5), TmaTiles(32, 256, 4, 4))
    assert moe_decode.decode_tiles(1, None, 4096).fused == (TmaTiles(16, 256, 4, 5), TmaTiles(16, 512, 4, 3))
    assert moe_decode.decode_tiles(1, 128, 4096).fused == (TmaTiles(16, 256, 4, 5), TmaTiles(32, 256, 4, 4))
    assert all(moe_decode.decode_tiles(m, b, d).fused is None for m, b, d in
               ((8, 128, 4096), (8, 32, 4096), (8, None, 4096), (1, 32, 2048), (1, None, 2048), (1, 128, 2048)))
    fused = (TmaTiles(16, 32, 4, 3), TmaTiles(16, 64, 4, 2))
    monkeypatch.setattr(moe_decode, "FUSED", {moe_decode.table_key(1, 32, 96): fused})
    launches = _count_launches(monkeypatch, "fused")
    args = _off_tile_experts(1, 32, seed=9)
    y = moe_decode.decode_experts(*args, 10.0)
    assert launches["tma"] == 1
    assert rel_err(y, moe.moe_experts_ref(*args, swiglu_limit=10.0)) < TOL[torch.float32]
    w1, w2, w3, s1, s2, s3 = expert_weights(8, 96, 72, torch.float32, seed=1, fp8_block=32)  # rows of 72 bytes
    x, weights, ids = args[:3]
    y = moe_decode.decode_experts(x, weights, ids, w1, w2, w3, s1, s2, s3, 10.0)
    assert launches["tma"] == 1
    assert rel_err(y, moe.moe_experts_ref(x, weights, ids, w1, w2, w3, s1, s2, s3, swiglu_limit=10.0)) \
        < TOL[torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the tables' TMA entries at V4-Flash widths")
@pytest.mark.parametrize("n_tok,fp8_block", [(1, 32), (1, 128), (1, None), (8, None)])
def test_the_tables_tma_entries_at_v4_flash_widths(n_tok, fp8_block, poisoned):
    """On the GPU at the widths the entries were measured for (D 4096, I 2048, top-6 of 8 experts, bf16 x):
    the shipped tables (`FUSED` at one token, `DOWN_TMA` at 8) against the same tiles without them, and the
    reference, within bf16's bound."""
    args = _expert_case(n_tok, 4096, 8, 6, 2048, 2048, fp8_block, torch.bfloat16)
    tiles = moe_decode.decode_tiles(n_tok, fp8_block, 4096)
    assert (tiles.fused is not None) == (n_tok == 1) and (tiles.down_tma is not None) == (n_tok == 8)
    with poisoned():
        y = moe_decode.decode_experts(*args, 10.0)
    two = moe_decode.decode_experts(*args, 10.0, tiles=tiles._replace(fused=None, down_tma=None))
    assert rel_err(y, two) < TOL[torch.bfloat16]
    assert rel_err(y, moe.moe_experts_ref(*args, swiglu_limit=10.0)) < TOL[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the early shared rows under PDL, against the router")
@pytest.mark.parametrize("n_tok,fp8_block", [(1, 128), (1, 32), (1, None), (8, 32), (8, 128)])
def test_fused_moe_early_shared_rows_on_the_gpu(n_tok, fp8_block):
    """On the GPU (PDL on Hopper) at V4-Flash widths: `fused_moe`, whose one launch (`FUSED`; its counters made
    before the router) or gate/up launch (8 tokens) starts the shared rows while the router's select kernel
    runs (one token; at 8 tokens, past `EARLY_MAX_TOKENS`, the usual launch), equals
    the router then the experts without the promise, bit for bit, 20 times over (a shared row stored before
    the router finished, x read early, or a counter not zeroed in time would show)."""
    x, _, _, w1, w2, w3, s1, s2, s3 = _expert_case(n_tok, 4096, 16, 6, 2048, 2048, fp8_block, torch.bfloat16)
    gate = torch.randn(16, 4096, generator=torch.Generator().manual_seed(5)).to(x.device, torch.bfloat16) / 64
    bias = torch.zeros(16, device=x.device)
    route = dict(top_k=6, routed_scaling_factor=1.5, hash_routing=False)
    tiles = moe_decode.decode_tiles(n_tok, fp8_block, 4096)
    assert (tiles.fused is not None) == (n_tok == 1)
    weights, ids = moe.moe_route(x, gate, bias, None, None, **route)
    late = moe_decode.decode_experts(x, weights, ids.int(), w1, w2, w3, s1, s2, s3, 10.0)
    for _ in range(20):
        assert torch.equal(moe.fused_moe(x, gate, bias, None, None, w1, w2, w3, s1, s2, s3, **route,
                                         swiglu_limit=10.0), late)
