"""Lightning indexer (dspark/kernels/indexer.py): fused Triton vs the torch reference, and the tie rule.

Rows are decode / verify / prefill-like: each row s sees entries t < visible[s] (0 for a query
before the first complete entry), optionally only inside a V4.1 candidate pool. Ids must be equal
(random inputs have no near-ties); scores agree within the dtype's bound and are −inf exactly where
the reference masks. The tie rule is tested on integer-valued inputs, whose scores are exact in
every implementation, so ties are real ties for both.
"""

import pytest
import torch

from dspark.kernels import indexer, indexer_ref, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-5}  # bf16 operands are exact in fp32: only the sum order differs


def make_inputs(n_q, n_heads, head_dim, n_keys, dtype, seed, pool=False, integer=False):
    """q [S, Hi, di], weights [S, Hi] fp32, keys [T, di], visible [S], candidates [S, T] bool or None."""
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers, power-of-two weights: every score exact, many exact ties
        q = torch.randint(-2, 3, (n_q, n_heads, head_dim), generator=g).float()
        keys = torch.randint(-1, 2, (n_keys, head_dim), generator=g).float()
        weights = 2.0 ** torch.randint(-2, 2, (n_q, n_heads), generator=g).float()
    else:
        q = torch.randn(n_q, n_heads, head_dim, generator=g)
        keys = torch.randn(n_keys, head_dim, generator=g)
        weights = torch.randn(n_q, n_heads, generator=g)  # negative head weights occur in real models
    visible = torch.randint(0, n_keys + 1, (n_q,), generator=g)
    visible[-1] = n_keys  # the newest row sees everything
    candidates = torch.rand(n_q, n_keys, generator=g) < 0.6 if pool else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return q.to(DEVICE, dtype), to(weights), keys.to(DEVICE, dtype), to(visible), to(candidates)


def check(args, topk, dtype):
    ids, scores = indexer.lightning_indexer(*args, topk=topk)
    ref_ids, ref_scores = indexer.lightning_indexer_ref(*args, topk=topk)
    assert ids.dtype == torch.int64 and ids.shape == ref_ids.shape == (args[0].shape[0], min(topk, args[2].shape[0]))
    assert torch.equal(ids, ref_ids)
    finite = ref_scores.isfinite()
    assert torch.equal(scores.isfinite(), finite) and not scores.isnan().any()
    assert torch.equal(scores[~finite], ref_scores[~finite])  # −inf on every unreachable entry
    if finite.any():
        a, b = scores[finite].double(), ref_scores[finite].double()
        assert ((a - b).norm() / b.norm().clamp(min=1e-30)).item() < TOL[dtype]
    return ids, scores


CASES = [  # (S, Hi, di, T, k, candidate pool)
    (1, 4, 32, 1, 4, False),  # first entry, k > T
    (1, 64, 128, 70, 16, False),  # one decode row, V4-Flash heads/dims
    (4, 3, 24, 45, 8, True),  # verify block, heads and dims off the tiles, candidate pool
    (11, 16, 32, 130, 7, True),  # several row blocks and key tiles
    (3, 32, 128, 20, 32, False),  # k > T: all visible entries, −1 padded
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_heads,head_dim,n_keys,topk,pool", CASES)
def test_lightning_indexer_matches_ref(n_q, n_heads, head_dim, n_keys, topk, pool, dtype, poisoned):
    args = make_inputs(n_q, n_heads, head_dim, n_keys, dtype, seed=n_q * 7 + n_keys, pool=pool)
    with poisoned():
        ids, _ = check(args, topk, dtype)
    visible = args[3]
    assert ((ids < visible[:, None]) | (ids == -1)).all()
    if pool:  # the candidate mask is fused: nothing outside the pool is ever picked
        rows = torch.arange(n_q, device=ids.device)[:, None].expand_as(ids)
        assert args[4][rows[ids >= 0], ids[ids >= 0]].all()


@needs_triton
@pytest.mark.parametrize("pool", [False, True])
def test_streaming_selection_over_long_rows(monkeypatch, poisoned, pool):
    """Rows longer than the register tile take the multi-pass path (shrunk here to 16 entries)."""
    monkeypatch.setattr(indexer, "_REGISTER_ROW", 16)
    monkeypatch.setattr(indexer, "_STREAM_TILE", 16)
    monkeypatch.setattr(indexer, "_REGISTER_TAIL", 0)  # no register tail: stream
    for integer in (False, True):
        args = make_inputs(5, 4, 16, 77, torch.float32, seed=5, pool=pool, integer=integer)
        with poisoned():
            check(args, 9, torch.float32)


@needs_triton
@pytest.mark.parametrize("n_q,n_keys,topk,long_rows", [(1, 1, 4, False), (3, 70, 16, False), (5, 130, 7, False),
                                                       (4, 77, 9, True), (2, 20, 32, False)])
def test_select_topk_matches_ref(n_q, n_keys, topk, long_rows, poisoned, monkeypatch):
    """`select_topk` (the selection alone, what the static steps call on their batched scores) ==
    `select_topk_ref` bit for bit: random scores, exact ties (small integers), −inf rows and entries,
    k > T; rows over the register tile take the streamed passes (tile shrunk to 16)."""
    if long_rows:
        monkeypatch.setattr(indexer, "_REGISTER_ROW", 16)
        monkeypatch.setattr(indexer, "_STREAM_TILE", 16)
        monkeypatch.setattr(indexer, "_REGISTER_TAIL", 0)  # no register tail: stream
    g = torch.Generator().manual_seed(n_q * 31 + n_keys)
    for integer in (False, True):
        scores = (torch.randint(-3, 4, (n_q, n_keys), generator=g).float() if integer
                  else torch.randn(n_q, n_keys, generator=g))
        scores[torch.rand(n_q, n_keys, generator=g) < 0.3] = float("-inf")
        scores[0] = float("-inf") if n_q > 1 else scores[0]  # a row that can see nothing yet
        scores = scores.to(DEVICE)
        with poisoned():
            ids = indexer.select_topk(scores, topk)
        assert torch.equal(ids, indexer.select_topk_ref(scores, topk))
    with pytest.raises(ValueError, match="scores must be fp32"):
        indexer.select_topk(scores.double(), topk)
    with pytest.raises(ValueError, match="topk must be a positive int, got 0"):
        indexer.select_topk(scores, 0)


def test_register_tiles_cover_the_row_with_two_powers_of_two():
    """A static bucket's rows (capacity = context + headroom) are just past a power of two: the
    selection keeps them in a tile of that power and a short tail, not in one tile twice the row."""
    assert indexer.register_tiles(1) == (16, 0)
    assert indexer.register_tiles(1024) == (1024, 0)
    assert indexer.register_tiles(1040) == (1024, 16)  # v4-mini at 4K + 64: ratio 4
    assert indexer.register_tiles(4160) == (4096, 64)  # v41-mini at 4K + 64: ratio 1
    assert indexer.register_tiles(6000) == (4096, 2048)
    assert indexer.register_tiles(8208) == (8192, 16)  # 32K + 64, ratio 4: registers, not L2 passes
    assert indexer.register_tiles(8192 + 1024) == (8192, 1024)
    assert indexer.register_tiles(8192 + 1025) is None  # streams through L2


@needs_triton
@pytest.mark.parametrize("topk", [5, 20, 90])
def test_selection_past_the_register_row_keeps_a_tail_in_registers(topk, poisoned, monkeypatch):
    """With the register row shrunk to 16 entries, rows of 17..16+64 entries keep the rest in a
    register tail (`register_tiles`), longer ones stream: both == the reference, ties at the cut
    straddling the two tiles (small integers), −inf entries, k above the finite count."""
    monkeypatch.setattr(indexer, "_REGISTER_ROW", 16)
    monkeypatch.setattr(indexer, "_STREAM_TILE", 16)
    monkeypatch.setattr(indexer, "_REGISTER_TAIL", 64)
    g = torch.Generator().manual_seed(topk)
    for n_keys, tiles in ((17, (16, 16)), (50, (16, 64)), (80, (16, 64)), (81, None)):
        assert indexer.register_tiles(n_keys) == tiles
        scores = torch.randint(-2, 3, (3, n_keys), generator=g).float()
        scores[torch.rand(3, n_keys, generator=g) < 0.25] = float("-inf")
        scores = scores.to(DEVICE)
        with poisoned():
            ids = indexer.select_topk(scores, topk)
        assert torch.equal(ids, indexer.select_topk_ref(scores, topk)), n_keys


@needs_triton
@pytest.mark.parametrize("radix_bits", [1, 2, 4, 8])
@pytest.mark.parametrize("long_rows", [False, True])
def test_select_radix_widths_match_ref(radix_bits, long_rows, poisoned, monkeypatch):
    """θ found 1, 2, 4 or 8 bits per pass (1: the former bisection; 4: shipped) gives the reference's
    ids bit for bit over keys spread across the whole int32 order: ±inf, ±0, subnormals, ±huge, ties
    at the cut, k at, above and below the finite count, one row (the batch-1 decode) and several."""
    if long_rows:
        monkeypatch.setattr(indexer, "_REGISTER_ROW", 16)
        monkeypatch.setattr(indexer, "_STREAM_TILE", 16)
        monkeypatch.setattr(indexer, "_REGISTER_TAIL", 0)  # no register tail: stream
    g = torch.Generator().manual_seed(radix_bits)
    special = torch.tensor([float("inf"), -0.0, 0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, 1.0, -2.0])
    scores = torch.randn(3, 45, generator=g) * torch.logspace(-30, 30, 45)
    scores[:, ::4] = special[torch.randint(0, len(special), (3, 12), generator=g)]
    scores[torch.rand(3, 45, generator=g) < 0.2] = float("-inf")
    scores = scores.to(DEVICE)
    for rows, topk in ((1, 7), (3, 12), (3, 40), (1, 64)):
        with poisoned():
            ids = indexer.launch_select_topk(scores[:rows], topk, None, None, radix_bits)
        assert torch.equal(ids, indexer.select_topk_ref(scores[:rows], topk))
    with pytest.raises(ValueError, match="radix_bits must be 1, 2, 4 or 8, got 3"):
        indexer.launch_select_topk(scores, 4, None, None, 3)


@needs_triton
@pytest.mark.parametrize("long_rows", [False, True])
def test_select_topk_offset_and_out_write_the_key_list(long_rows, monkeypatch):
    """With `offset` and `out` (the V4 static step's CSA key list: window columns, then the picks as
    pool rows) the kernel stores ids + offset[s] (−1 kept) into the strided tail of the list and
    leaves the window columns alone; the reference does the same and equals the plain selection
    shifted."""
    if long_rows:
        monkeypatch.setattr(indexer, "_REGISTER_ROW", 16)
        monkeypatch.setattr(indexer, "_STREAM_TILE", 16)
        monkeypatch.setattr(indexer, "_REGISTER_TAIL", 0)  # no register tail: stream
    g = torch.Generator().manual_seed(3)
    n_q, n_keys, topk, window = 4, 40, 9, 5
    scores = torch.randn(n_q, n_keys, generator=g)
    scores[torch.rand(n_q, n_keys, generator=g) < 0.5] = float("-inf")
    scores[1] = float("-inf")
    scores = scores.to(DEVICE)
    offset = torch.randint(100, 1000, (n_q, 1), generator=g).to(DEVICE)
    plain = indexer.select_topk_ref(scores, topk)
    expected = torch.where(plain >= 0, plain + offset, -1)
    for op in (indexer.select_topk, indexer.select_topk_ref):
        keys = torch.randint(-1, 50, (n_q, window + topk), generator=g).to(DEVICE)
        head = keys[:, :window].clone()
        assert op(scores, topk, offset=offset, out=keys[:, window:]).data_ptr() == keys[:, window:].data_ptr()
        assert torch.equal(keys[:, window:], expected) and torch.equal(keys[:, :window], head)
        assert torch.equal(op(scores, topk, offset=offset.view(-1)), expected)
    with pytest.raises(ValueError, match="offset must be int64"):
        indexer.select_topk(scores, topk, offset=offset.int())
    with pytest.raises(ValueError, match="out must be int64"):
        indexer.select_topk_ref(scores, topk, out=torch.empty(n_q, topk + 1, dtype=torch.long, device=DEVICE))


def test_tie_rule_prefers_lower_ids():
    """Scores [1, 3, 3, 0, 3, (invisible)]: ties at 3 go to the lower ids; output ascending."""
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, float("-inf")]])
    assert indexer_ref.select_topk_ref(scores, 2).tolist() == [[1, 2]]
    assert indexer_ref.select_topk_ref(scores, 4).tolist() == [[0, 1, 2, 4]]
    assert indexer_ref.select_topk_ref(scores, 8).tolist() == [[0, 1, 2, 3, 4, -1]]
    zeros = torch.tensor([[0.0, -0.0, 0.0, -1.0]])  # −0 ties with +0 like any float comparison
    assert indexer_ref.select_topk_ref(zeros, 2).tolist() == [[0, 1]]


@needs_triton
def test_kernel_follows_the_tie_rule():
    """The same hand-made row through the kernel (one head, di 1: score = key value), then many
    exact ties (integer inputs, ReLU zeros) against the reference."""
    q = torch.ones(1, 1, 1, device=DEVICE)
    keys = torch.tensor([[1.0], [3.0], [3.0], [0.0], [3.0], [5.0]], device=DEVICE)
    args = (q, torch.ones(1, 1, device=DEVICE), keys, torch.tensor([5], device=DEVICE), None)
    assert indexer.lightning_indexer(*args, topk=2)[0].tolist() == [[1, 2]]
    assert indexer.lightning_indexer(*args, topk=4)[0].tolist() == [[0, 1, 2, 4]]
    for pool in (False, True):
        args = make_inputs(6, 4, 8, 60, torch.float32, seed=11, pool=pool, integer=True)
        _, scores = check(args, 10, torch.float32)
        # The inputs do tie at the cut: some row has more entries at its k-th score than it takes.
        kth = scores.sort(dim=-1, descending=True).values[:, 9:10]
        assert ((scores == kth).sum(-1) > 1).any()


def test_reference_validates_arguments():
    q, w, keys, visible, _ = make_inputs(2, 4, 8, 10, torch.float32, seed=0)
    op = indexer_ref.lightning_indexer_ref
    with pytest.raises(ValueError, match="weights"):
        op(q, w[:, :2], keys, visible, None, topk=3)
    with pytest.raises(ValueError, match="keys"):
        op(q, w, keys[:, :4], visible, None, topk=3)
    with pytest.raises(ValueError, match="visible"):
        op(q, w, keys, visible.float(), None, topk=3)
    with pytest.raises(ValueError, match="candidates"):
        op(q, w, keys, visible, torch.ones(2, 10), topk=3)
    with pytest.raises(ValueError, match="topk"):
        op(q, w, keys, visible, None, topk=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n_q", [1, 8, 64, 256])
@pytest.mark.parametrize("n_heads,n_keys,topk,pool", [(64, 8192, 512, False), (32, 32768, 1024, True)])
def test_real_shapes_on_gpu(n_q, n_heads, n_keys, topk, pool):
    """32K context: V4-Flash CSA (64 heads, T = 8192 entries, top-512) and V4.1 ratio-1 reindex
    (32 heads, T = 32768, top-1024 inside a candidate pool; the streaming selection path), bf16."""
    args = make_inputs(n_q, n_heads, 128, n_keys, torch.bfloat16, seed=n_q, pool=pool)
    check(args, topk, torch.bfloat16)


def group_inputs(n_groups, n_q, n_heads, head_dim, n_keys, dtype, seed, spaced=0, empty_first=True):
    """`index_scores` inputs: B groups, keys [B, T, di] as a prefix of [B, T + spaced, di] rows (the
    static state's layout), visible counts from 1 to T, and 0 (nothing yet) for the first row when
    `empty_first`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_groups, n_q, n_heads, head_dim, generator=g).to(DEVICE, dtype)
    weights = (torch.rand(n_groups, n_q, n_heads, generator=g) - 0.3).to(DEVICE)
    block = torch.randn(n_groups, n_keys + spaced, head_dim, generator=g).to(DEVICE, dtype)
    visible = torch.randint(1, n_keys + 1, (n_groups, n_q), generator=g).to(DEVICE)
    if empty_first:
        visible[0, 0] = 0
    return q, weights, block[:, :n_keys], visible


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_groups,n_q,n_heads,head_dim,n_keys,spaced", [
    (3, 1, 4, 32, 40, 1),  # decode: one row per slot, keys a prefix of each slot's rows (trash row after)
    (2, 5, 16, 64, 70, 0),  # verify blocks, dense keys
    (1, 3, 3, 48, 9, 2),  # heads and head dim off the tiles
])
def test_index_scores_match_ref(n_groups, n_q, n_heads, head_dim, n_keys, spaced, dtype, poisoned):
    args = group_inputs(n_groups, n_q, n_heads, head_dim, n_keys, dtype, seed=n_keys + spaced, spaced=spaced)
    with poisoned():
        scores = indexer.index_scores(*args)
    ref = indexer_ref.index_scores_ref(*args)
    assert scores.shape == ref.shape == (n_groups, n_q, n_keys) and scores.dtype == torch.float32
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))  # the same entries masked
    finite = torch.isfinite(ref)
    err = ((scores[finite].double() - ref[finite].double()).norm() / ref[finite].double().norm()).item()
    assert err < TOL[dtype]
    # group b of the batched launch is exactly group b launched alone (the per-group offsets)
    for b in range(n_groups):
        assert torch.equal(indexer.index_scores(*(t[b : b + 1] for t in args))[0], scores[b])


def test_index_scores_reference_validates_arguments():
    q, weights, keys, visible = group_inputs(2, 1, 4, 32, 10, torch.float32, seed=0)
    with pytest.raises(ValueError, match="q must be"):
        indexer_ref.index_scores_ref(q[0], weights, keys, visible)
    with pytest.raises(ValueError, match="keys must be"):
        indexer_ref.index_scores_ref(q, weights, keys[:1], visible)
    with pytest.raises(ValueError, match="visible must be"):
        indexer_ref.index_scores_ref(q, weights, keys, visible.float())


@pytest.mark.gpu
@pytest.mark.parametrize("n_groups,n_q", [(1, 1), (64, 1), (256, 4)])
def test_index_scores_real_shapes_on_gpu(n_groups, n_q):
    """v4-mini / V4-Flash index heads (64 × 128) over 8192 entries per slot (32K context), bf16,
    keys a prefix of each slot's E + 1 rows."""
    args = group_inputs(n_groups, n_q, 64, 128, 8192, torch.bfloat16, seed=n_groups, spaced=1, empty_first=n_groups > 1)
    scores, ref = indexer.index_scores(*args), indexer_ref.index_scores_ref(*args)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(scores))
    assert ((scores[finite] - ref[finite]).norm() / ref[finite].norm()).item() < TOL[torch.bfloat16]
