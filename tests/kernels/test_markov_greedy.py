"""`markov_greedy` (dspark/kernels/markov_greedy.py), the Markov head's fused greedy slot, against its
reference greedy(base.float() + E · W2ᵀ): random inputs over shapes off every tile (tokens must be
equal: the top-two margins of random logits dwarf the product's rounding), both product orientations
and strided rows, ties to the lowest index (integer inputs, exact in every precision), NaN / ±inf
as torch.argmax, argument errors, the registry; on a GPU the drafter's real shapes and a CUDA graph.

On CPU the kernel runs under the Triton interpreter (conftest.py), which ignores `input_precision`
(its `tl.dot` is a NumPy fp32 matmul whatever the option): there both precisions only check the
kernel's logic; the tensor-core accuracy of "tf32x3" is what the GPU tests measure.
"""

import pytest
import torch

from dspark.draft.markov_head import MarkovHead
from dspark.kernels import KernelConfig, get_op, triton_available
from dspark.kernels import markov_greedy as mg
from dspark.sampling import greedy

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(n_rows, vocab, rank, base_dtype=torch.float32, seed=0, device=DEVICE):
    """Random normal base, E and W2 (bias ~ N(0, 1), like base): never zeros, seeded."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n_rows, vocab, generator=g).to(base_dtype)
    embed = torch.randn(n_rows, rank, generator=g)
    weight = torch.randn(vocab, rank, generator=g) * rank**-0.5
    return base.to(device), embed.to(device), weight.to(device)


def margin(base, embed, weight) -> float:
    """Smallest top-1 / top-2 gap of any row's fp64 logits (how near a tie the data came)."""
    top = (base.double() + embed.double() @ weight.double().T).topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


@needs_triton
@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [16, 32])
@pytest.mark.parametrize("vocab", [257, 1000])
@pytest.mark.parametrize("n_rows", [1, 5, 17])
def test_matches_reference_on_random_inputs(n_rows, vocab, rank, base_dtype, poisoned):
    """Default tiles: V off the chunk size, S off the row block (17: two row blocks at BLOCK_S 16, one
    padded block of 32 by the table). Every partial written (the buffers start as NaN / −1)."""
    base, embed, weight = make_inputs(n_rows, vocab, rank, base_dtype, seed=n_rows * 1000 + vocab + rank)
    with poisoned():
        got = mg.markov_greedy(base, embed, weight)
    want = mg.markov_greedy_ref(base, embed, weight)
    assert got.dtype == torch.long and got.shape == (n_rows,) and got.device == base.device
    assert torch.equal(got, want), f"min margin {margin(base, embed, weight):.2e}"


@needs_triton
@pytest.mark.parametrize("tiles", [
    mg.Tiles(16, 64, 16, True, 4, 2),    # swapped product, r in 3 steps, the last one masked (r = 40)
    mg.Tiles(16, 64, 16, False, 4, 2),   # the same, E · W2ᵀ
    mg.Tiles(32, 16, 64, False, 4, 2),   # BLOCK_R > r (one masked step), many 16-wide chunks
    mg.Tiles(16, 128, 32, True, 4, 2),   # the last chunk mostly past V
])
@pytest.mark.parametrize("precision", mg.PRECISIONS)
def test_tiles_and_precisions(tiles, precision, poisoned):
    """Both orientations, masked rank steps, two row blocks (S = 19 > BLOCK_S), each precision."""
    base, embed, weight = make_inputs(19, 300, 40, seed=3)
    with poisoned():
        got = mg.markov_greedy(base, embed, weight, input_precision=precision, tiles=tiles)
    assert torch.equal(got, mg.markov_greedy_ref(base, embed, weight)), f"min margin {margin(base, embed, weight):.2e}"


@needs_triton
def test_strided_rows_and_columns():
    """base[:, k] of an [S, γ, V] block (the drafter's slot k: strided rows, read in place), and a base
    whose last dim is not contiguous (copied)."""
    _, embed, weight = make_inputs(6, 500, 32, seed=5)
    block = torch.randn(6, 3, 500, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    for k in range(3):
        slot = block[:, k]
        assert torch.equal(mg.markov_greedy(slot, embed, weight), mg.markov_greedy_ref(slot, embed, weight))
    columns = block[:, 0].T.contiguous().T  # [S, V] with stride (1, S)
    assert columns.stride(1) != 1
    assert torch.equal(mg.markov_greedy(columns, embed, weight), mg.markov_greedy_ref(columns, embed, weight))


@needs_triton
def test_is_the_vanilla_heads_greedy_slot():
    """markov_greedy(U_k, W1[x_{k−1}], W2) is the token `sample_chain` picks at temperature 0."""
    head = MarkovHead(700, 32, hidden_size=8, device=DEVICE)
    g = torch.Generator().manual_seed(11)
    prev = torch.randint(0, 700, (4,), generator=g).to(DEVICE)
    base = torch.randn(4, 700, generator=g).to(DEVICE)
    with torch.no_grad():
        bias, _ = head.step(None, prev, None)
        want = greedy(base + bias)
        got = mg.markov_greedy(base, head.embed(prev), head.head.weight)
    assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("tiles", [None, mg.Tiles(16, 32, 16, False, 4, 2), mg.Tiles(16, 32, 16, True, 4, 2)])
def test_ties_go_to_the_lowest_index(tiles):
    """Integer inputs (|values| small: every product, sum and TF32 split exact in any order) with many
    equal logits: the kernel's token is the reference's, i.e. the first maximum, whether the tied
    entries share a chunk or not. Then a constructed tie: equal W2 rows for the tied entries."""
    g = torch.Generator().manual_seed(7)
    n_rows, vocab, rank = 9, 200, 24
    base = torch.randint(-3, 4, (n_rows, vocab), generator=g).float().to(DEVICE)
    embed = torch.randint(-2, 3, (n_rows, rank), generator=g).float().to(DEVICE)
    weight = torch.randint(-1, 2, (vocab, rank), generator=g).float().to(DEVICE)
    logits = base + embed @ weight.T
    assert ((logits == logits.max(-1, keepdim=True).values).sum(-1) > 1).any()  # real ties, else no test
    assert torch.equal(mg.markov_greedy(base, embed, weight, tiles=tiles), mg.markov_greedy_ref(base, embed, weight))

    base, embed, weight = make_inputs(3, 200, 16, seed=8)
    embed, weight = (embed * 8).round() / 8, (weight * 8).round() / 8  # multiples of 1/8: exact products
    tied = (37, 41, 150)  # within one 32-wide chunk (37, 41) and across chunks (41, 150)
    weight[list(tied)] = weight[tied[0]].clone()
    base[:, list(tied)] = 50.0  # far above every other logit
    want = torch.full((3,), tied[0], dtype=torch.long, device=DEVICE)
    assert torch.equal(mg.markov_greedy_ref(base, embed, weight), want)
    assert torch.equal(mg.markov_greedy(base, embed, weight, tiles=tiles), want)
    base[:, tied[0]] = -50.0
    assert torch.equal(mg.markov_greedy(base, embed, weight, tiles=tiles), want + tied[1] - tied[0])


@needs_triton
def test_nan_and_inf_as_torch_argmax():
    """NaN counts as the maximum (the first NaN wins, even over +inf in an earlier chunk); +inf ties to
    the lowest index; a row of −inf gives 0 (torch.argmax's first maximum)."""
    base, embed, weight = make_inputs(5, 300, 16, seed=9)
    base[0, [130, 250]] = float("nan")
    base[0, 5] = float("inf")
    base[1, [70, 12]] = float("inf")
    base[2] = float("-inf")
    base[3, 299] = float("nan")  # in the partial last chunk
    tiles = mg.Tiles(16, 64, 16, True, 4, 2)
    want = torch.tensor([130, 12, 0, 299], device=DEVICE)
    assert torch.equal(mg.markov_greedy_ref(base, embed, weight)[:4], want)
    got = mg.markov_greedy(base, embed, weight, tiles=tiles)
    assert torch.equal(got, mg.markov_greedy_ref(base, embed, weight))
    assert torch.equal(mg.markov_greedy(base, embed, weight, tiles=tiles._replace(swap=False)), got)


@needs_triton
def test_no_rows():
    base, embed, weight = make_inputs(0, 50, 16)
    assert mg.markov_greedy(base, embed, weight).shape == (0,)
    assert mg.markov_greedy_ref(base, embed, weight).shape == (0,)


@pytest.mark.parametrize("fn", [mg.markov_greedy_ref, mg.markov_greedy])
def test_bad_arguments_name_the_argument(fn):
    base, embed, weight = make_inputs(3, 50, 16, device="cpu")
    cases = [
        ((base[0], embed, weight), "base"),
        ((base.long(), embed, weight), "base"),
        ((base[:, :0], embed, weight[:0]), "base"),
        ((base, embed[:2], weight), "prev_embed"),
        ((base, embed.bfloat16(), weight), "prev_embed"),
        ((base, embed[None], weight), "prev_embed"),
        ((base, embed, weight[:49]), "head_weight"),
        ((base, embed, weight[:, :8]), "head_weight"),
        ((base, embed, weight.double()), "head_weight"),
        ((base, embed.to("meta"), weight), "prev_embed"),
        ((base, embed, weight.to("meta")), "head_weight"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            fn(*args)


@needs_triton
def test_bad_options():
    base, embed, weight = make_inputs(3, 50, 16)
    with pytest.raises(ValueError, match="input_precision"):
        mg.markov_greedy(base, embed, weight, input_precision="tf32")
    with pytest.raises(ValueError, match="tiles"):
        mg.markov_greedy(base, embed, weight, tiles=mg.Tiles(8, 64, 16, True, 4, 2))


def test_default_tiles():
    """BLOCK_S covers S up to 64 (W2 read from HBM once per call; above, the other row blocks read it
    from L2), BLOCK_R never above r (rounded up, >= 16)."""
    for n_rows in (1, 8, 16, 17, 64, 65, 128, 256):
        for rank in (8, 32, 64, 128, 256):
            for precision in mg.PRECISIONS:
                tiles = mg.default_tiles(n_rows, rank, precision)
                assert tiles.block_s >= min(n_rows, 64) and tiles.block_s >= 16
                assert 16 <= tiles.block_r <= max(16, rank)


@needs_triton
@pytest.mark.parametrize("head_type", ["markov", "rnn"])
def test_drafters_greedy_chains_run_the_configured_op(head_type, monkeypatch):
    """A DSpark drafter whose kernels pick markov_greedy="triton" drafts every greedy slot of the
    vanilla head through the fused op (dynamic `propose` and the static drafter's chain), with the
    tokens of the reference drafter; the RNN head keeps its own step (its bias depends on the state)."""
    import dspark
    from dspark.draft import DSparkConfig, DSparkDrafter
    from dspark.draft.static_drafter import StaticDrafter, StaticDraftShape
    from dspark.sampling import SamplingParams

    calls = []
    fused = mg.markov_greedy

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return fused(*args, **kwargs)

    monkeypatch.setattr(mg, "markov_greedy", spy)
    drafters = {}
    for impl in ("ref", "triton"):
        model = dspark.init_model("tiny-v4", seed=0, kernels=KernelConfig(markov_greedy=impl))
        config = DSparkConfig.for_target(model.config, dspark_markov_rank=32, dspark_markov_head_type=head_type)
        drafters[impl] = (model, DSparkDrafter(model, config).init_weights(3))
    g = torch.Generator().manual_seed(5)
    out = {}
    for impl, (model, drafter) in drafters.items():
        states = []
        for length in (3, 9):
            ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
            hidden = model(ids, [model.new_state()], [length], capture_layers=drafter.capture_layers)
            states.append(drafter.new_state())
            drafter.observe(states[-1], ids, hidden.hidden, hidden.features)
        anchors = [7, 11]
        dynamic = drafter.propose(states, anchors, SamplingParams(), [g, g]).tokens
        static = StaticDrafter(drafter, StaticDraftShape(slots=2, tokens=drafter.block_size + 1))
        positions = [static.load(slot, state) for slot, state in enumerate(states)]
        out[impl] = (dynamic, static.propose(*static.plan(anchors, positions, None)[:2]).tokens)
    assert torch.equal(out["triton"][0], out["ref"][0]) and torch.equal(out["triton"][1], out["ref"][1])
    gamma = drafters["ref"][1].block_size
    assert len(calls) == (2 * gamma if head_type == "markov" else 0)  # γ slots, dynamic then static


@needs_triton
def test_registry():
    assert get_op(KernelConfig(), "markov_greedy") is mg.markov_greedy_ref
    assert get_op(KernelConfig(markov_greedy="triton"), "markov_greedy") is mg.markov_greedy


@pytest.mark.gpu
@pytest.mark.parametrize("precision", mg.PRECISIONS)
@pytest.mark.parametrize("n_rows", [1, 8, 64, 256])
def test_drafter_shapes_on_gpu(n_rows, precision):
    """V4's vocabulary and the drafter's rank (V = 129280, r = 256), default tiles: no token may
    differ from the reference's (cuBLAS FP32). The data's smallest top-two margin is in the message:
    a mismatch with a margin near 1e-6 would be a near-tie, not a bug."""
    base, embed, weight = make_inputs(n_rows, 129280, 256, seed=n_rows)
    got = mg.markov_greedy(base, embed, weight, input_precision=precision)
    want = mg.markov_greedy_ref(base, embed, weight)
    bad = (got != want).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)} of {n_rows} rows differ ({bad[:8]}); min margin {margin(base, embed, weight):.2e}"
    base16 = base.bfloat16()
    assert torch.equal(mg.markov_greedy(base16, embed, weight, input_precision=precision),
                       mg.markov_greedy_ref(base16, embed, weight))


@pytest.mark.gpu
def test_cuda_graph_replay_on_gpu():
    """Captured once, replayed on new inputs written in place: equal to eager (no host sync inside)."""
    base, embed, weight = make_inputs(64, 129280, 256, seed=1)
    mg.markov_greedy(base, embed, weight)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mg.markov_greedy(base, embed, weight)
    new_base, new_embed, _ = make_inputs(64, 129280, 256, seed=2)
    base.copy_(new_base)
    embed.copy_(new_embed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mg.markov_greedy(base, embed, weight))
    assert torch.equal(out, mg.markov_greedy_ref(base, embed, weight))
