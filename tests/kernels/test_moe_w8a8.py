"""W8A8 experts (dspark/kernels/moe_w8a8.py): activation quantisation and the e4m3 × e4m3 grouped GEMMs.

`act_quant` must equal its torch reference bit for bit (q's bytes and the exponents), including the
amax floor and amaxes on and next to the powers of two where the exponent steps. The experts must
match the W8A8 reference (the same quantisation, fp32 GEMMs) far more closely than they match the
weights-only reference: the difference between those two is the activations' fp8 error, which a
kernel that forgot to quantise (or quantised with other scales) would not show.
"""

import json
from importlib import resources

import pytest
import torch

from dspark.api import init_model
from dspark.kernels import KernelConfig, get_op, moe, moe_w8a8, triton_available
from dspark.kernels.fp8 import FP8BlockWeight

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 7.0


def rel_err(out, ref) -> float:
    assert not out.isnan().any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def activations(n_rows, dim, block, dtype, seed):
    """x [M, D] with a different power-of-two range per block, an all-zero block (the amax floor), a
    block below the floor, and blocks whose amax is 448·2^k exactly and one fp32 step above it."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-12, 9, (n_rows, dim // block), generator=g).float())
    x = torch.randn(n_rows, dim, generator=g) * spread.repeat_interleave(block, 1)
    x[0, :block] = 0.0
    if n_rows > 1:
        x[1, :block] = torch.rand(block, generator=g) * 5e-5
    if n_rows > 2 and dim >= 3 * block:
        x[2, :block] = x[2, :block].clamp(-1, 1)
        x[2, 0] = 448.0 * 4  # amax exactly 448 · 2^2: scale 4
        x[2, block:2 * block] = x[2, block:2 * block].clamp(-1, 1)
        x[2, block] = torch.nextafter(torch.tensor(448.0 / 8), torch.tensor(1e9))  # just above 448 · 2^-3
    return x.to(DEVICE, dtype)


def expert_weights(n_exp, dim, inter, inter_s, seed, block):
    """(w1, w2, w3, shared_w1, shared_w2, shared_w3) made on DEVICE (the GPU test's V4-Flash sizes
    would take minutes on the CPU): FP8 with `block` (scales that change block by block), or bf16
    when block is None."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def make(*shape):
        w = torch.randn(*shape, generator=g, device=DEVICE) * shape[-1] ** -0.5
        if block is None:
            return w.to(torch.bfloat16)
        rows, cols = -(-shape[-2] // block), -(-shape[-1] // block)
        spread = torch.exp2(torch.randint(-3, 4, (*shape[:-2], rows, cols), generator=g, device=DEVICE).float())
        w = w * spread.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :shape[-2], :shape[-1]]
        return FP8BlockWeight.quantize(w, block)

    return (make(n_exp, inter, dim), make(n_exp, dim, inter), make(n_exp, inter, dim),
            make(inter_s, dim), make(dim, inter_s), make(inter_s, dim))


def routing(n_tok, n_exp, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(n_tok)]).int()
    return (torch.rand(n_tok, top_k, generator=g) + 0.5).to(DEVICE), ids.to(DEVICE)


# -------------------------------------------------------------------------------- act_quant


def test_act_quant_ref_exponents_on_hand_values():
    """The reference's scale 2^⌈log2(max(amax, 1e-4) / 448)⌉ at the boundaries, per 32 columns."""
    x = torch.zeros(5, 32)
    x[0, 3] = 448.0  # exactly 448: exponent 0
    x[1, 3] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))  # one step above: 1
    x[2, 3] = -224.0  # 448 / 2: -1 (the sign does not matter)
    x[3, 3] = 1e-6  # below the floor: the floor's exponent, ⌈log2(1e-4 / 448)⌉ = -22
    q, exponent = moe_w8a8.act_quant_ref(x, 32)  # row 4 all zero: the floor as well
    assert exponent[:, 0].tolist() == [0, 1, -1, -22, -22]
    assert q[0, 3].float() == 448.0 and q[1, 3].float() == 224.0 and q[2, 3].float() == -448.0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows,dim,block", [(5, 96, 32), (11, 384, 128), (9, 64, 64)])
def test_act_quant_matches_ref_bit_for_bit(n_rows, dim, block, dtype, poisoned):
    x = activations(n_rows, dim, block, dtype, seed=n_rows * dim)
    with poisoned():
        q, exponent = moe_w8a8.act_quant(x, block)
    want_q, want_e = moe_w8a8.act_quant_ref(x, block)
    assert exponent.dtype == want_e.dtype == torch.int32 and torch.equal(exponent, want_e)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_act_quant_rejects_bad_shapes():
    with pytest.raises(ValueError, match="D must be a multiple of 32, got D=40"):
        moe_w8a8.act_quant_ref(torch.randn(2, 40), 32)
    with pytest.raises(ValueError, match=r"x must be \[M, D\]"):
        moe_w8a8.act_quant_ref(torch.randn(40), 32)


# ------------------------------------------------------------------------------------- experts


CASES = [  # (N, D, E, K, I, I_s, block): decode tiles (16 rows) and prefill tiles (> 32 rows per expert)
    (5, 96, 8, 2, 64, 32, 32),  # 32×32 blocks, experts without tokens
    (6, 256, 4, 2, 128, 128, 128),  # V4's 128×128 blocks
    (70, 64, 3, 2, 96, 64, 32),  # the 64-row prefill tiles, I not a multiple of the 128-wide N tile
    (40, 128, 2, 1, 128, 128, None),  # dense bf16 weights: quantised with 128×128 blocks
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,dim,n_exp,top_k,inter,inter_s,block", CASES)
def test_moe_experts_w8a8_matches_the_w8a8_reference(n_tok, dim, n_exp, top_k, inter, inter_s, block, dtype,
                                                      poisoned):
    x = activations(n_tok, dim, 32, dtype, seed=n_tok) / 64  # O(1) rows with per-block ranges
    weights, ids = routing(n_tok, n_exp, top_k, seed=n_tok)
    ws = expert_weights(n_exp, dim, inter, inter_s, seed=dim, block=block)
    with poisoned():
        out = moe_w8a8.moe_experts_w8a8(x, weights, ids, *ws, swiglu_limit=LIMIT)
    ref = moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *ws, swiglu_limit=LIMIT)
    weights_only = moe.moe_experts_ref(x, weights, ids, *ws, swiglu_limit=LIMIT)
    assert out.dtype == x.dtype and out.shape == x.shape
    fp8_error = rel_err(ref, weights_only)  # what quantising the activations changes: a few percent
    assert 5e-3 < fp8_error < 0.1
    # the kernel vs the reference of its own arithmetic: summation order, h's occasional e4m3 step
    # (and bf16's output rounding: up to 2^-9 per element)
    assert rel_err(out, ref) < (2e-3 if dtype == torch.float32 else 6e-3) < fp8_error / 2


@needs_triton
def test_moe_experts_w8a8_takes_an_early_quantised_input(poisoned):
    """x_fp8 = act_quant(x, B) given by the caller gives the same bits as quantising in the op."""
    x = activations(20, 128, 32, torch.bfloat16, seed=3) / 64
    weights, ids = routing(20, 4, 2, seed=3)
    ws = expert_weights(4, 128, 64, 64, seed=3, block=32)
    want = moe_w8a8.moe_experts_w8a8(x, weights, ids, *ws, swiglu_limit=LIMIT)
    with poisoned():
        got = moe_w8a8.moe_experts_w8a8(x, weights, ids, *ws, swiglu_limit=LIMIT, x_fp8=moe_w8a8.act_quant(x, 32))
    assert torch.equal(got, want)
    ref = moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *ws, swiglu_limit=LIMIT)
    assert torch.equal(moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *ws, swiglu_limit=LIMIT,
                                                     x_fp8=moe_w8a8.act_quant_ref(x, 32)), ref)


@needs_triton
def test_w8a8_tiles_must_cover_whole_groups(monkeypatch):
    """A gate/up tile narrower than the block cannot quantise h per block: a clear error, not garbage."""
    x = activations(40, 128, 32, torch.bfloat16, seed=5) / 64
    weights, ids = routing(40, 2, 1, seed=5)
    ws = expert_weights(2, 128, 128, 128, seed=5, block=128)
    monkeypatch.setattr(moe_w8a8, "_tiles", lambda rows, block: (64, 64, 4, 4))
    with pytest.raises(ValueError, match="BLOCK_N a multiple of the block 128, got 64"):
        moe_w8a8.moe_experts_w8a8(x, weights, ids, *ws, swiglu_limit=LIMIT)


def test_moe_experts_w8a8_rejects_bad_weights():
    x = torch.randn(3, 64)
    weights, ids = torch.rand(3, 2), torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    ws = [w.cpu() if isinstance(w, torch.Tensor) else FP8BlockWeight(w.data.cpu(), w.scale.cpu(), w.block)
          for w in expert_weights(2, 64, 64, 64, seed=0, block=32)]
    mixed = list(ws)
    mixed[1] = FP8BlockWeight.quantize(ws[1].dequantize(), 64)
    with pytest.raises(ValueError, match=r"one FP8 block for all weights, got blocks \[32, 64\]"):
        moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *mixed, swiglu_limit=LIMIT)
    small = [FP8BlockWeight.quantize(w.dequantize(), 16) for w in ws]
    with pytest.raises(ValueError, match=r"take FP8 blocks \(32, 64, 128\), got 16"):
        moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *small, swiglu_limit=LIMIT)
    dense = [torch.randn(2, 96, 64), torch.randn(2, 64, 96), torch.randn(2, 96, 64),
             torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)]
    with pytest.raises(ValueError, match="D must be a multiple of 128, got D=64"):  # dense: 128×128 blocks
        moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *dense, swiglu_limit=LIMIT)
    with pytest.raises(ValueError, match=r"w2 must be \[E, D, I\]"):
        moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, ws[0], torch.randn(2, 64, 32), *ws[2:], swiglu_limit=LIMIT)


# ------------------------------------------------------------------------------- registry, model


def test_registry_w8a8_needs_the_fused_moe_and_exists_for_moe_experts_only():
    with pytest.raises(ValueError, match="moe_experts='w8a8' needs fused_moe='triton'"):
        KernelConfig(moe_experts="w8a8")
    with pytest.raises(ValueError, match="linear='w8a8': no w8a8 implementation"):
        KernelConfig(linear="w8a8")
    op = get_op(KernelConfig(fused_moe="triton", moe_experts="w8a8"), "moe_experts")
    assert isinstance(op, moe_w8a8.W8A8MoeExperts)


def test_registry_op_off_cuda_is_the_reference_and_converts_weights_once():
    """Off CUDA the op runs `moe_experts_w8a8_ref` bit for bit; dense weights are quantised at the
    first call and again only after an in-place change."""
    op = get_op(KernelConfig(fused_moe="triton", moe_experts="w8a8"), "moe_experts")
    x = torch.randn(6, 128).bfloat16()
    weights, ids = torch.rand(6, 2), torch.randint(0, 3, (6, 2), dtype=torch.int32)
    ws = [torch.randn(3, 128, 128).bfloat16(), torch.randn(3, 128, 128).bfloat16(), torch.randn(3, 128, 128).bfloat16(),
          torch.randn(128, 128).bfloat16(), torch.randn(128, 128).bfloat16(), torch.randn(128, 128).bfloat16()]
    first = op(x, weights, ids, *ws, swiglu_limit=LIMIT)
    assert torch.equal(first, moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *ws, swiglu_limit=LIMIT))
    assert op.quantize_input(x, *ws) is None  # no side stream off CUDA
    converted = op._fp8(ws)
    assert op._fp8(ws) is converted and converted[1] == moe_w8a8.DENSE_BLOCK
    ws[0].mul_(2)
    assert op._fp8(ws) is not converted
    assert not torch.equal(op(x, weights, ids, *ws, swiglu_limit=LIMIT), first)


@needs_triton
def test_model_moe_runs_the_w8a8_experts_with_its_router():
    """A V4 model's score-routed MoE layer with moe_experts='w8a8' gives the W8A8 reference of its own
    routing (tiny-v4 widened to 128 so that the dense weights take 128×128 blocks)."""
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    config.update(hidden_size=128, moe_intermediate_size=128)
    kernels = KernelConfig(moe_route="triton", fused_moe="triton", moe_experts="w8a8")
    layer = init_model(config, device=DEVICE, kernels=kernels).layers[-1].ffn
    assert isinstance(layer._experts_op, moe_w8a8.W8A8MoeExperts)
    x = torch.randn(24, 128, device=DEVICE).to(layer.shared_experts.w1.weight.dtype)
    ids = torch.randint(0, config["vocab_size"], (24,), device=DEVICE)
    with torch.no_grad():
        out = layer(x, ids)
        weights, experts = layer._routing(x, ids)
        s = layer.shared_experts
        want = moe_w8a8.moe_experts_w8a8_ref(x, weights, experts, *layer.stacked_weights(), s.w1.weight,
                                             s.w2.weight, s.w3.weight, swiglu_limit=layer.swiglu_limit)
    assert rel_err(out, want) < 6e-3


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_tok", [512, 2048])
@pytest.mark.parametrize("block", [128, 32])
def test_v4_flash_shapes_on_gpu(n_tok, block):
    """V4-Flash's expert shapes (D 4096, I 2048, top-6 of 64 experts here to keep the reference's
    loop short): W8A8 against its reference, and the side-stream input against the in-line one."""
    x = (torch.randn(n_tok, 4096, device="cuda") * 0.5).bfloat16()
    weights, ids = routing(n_tok, 64, 6, seed=n_tok)
    ws = expert_weights(64, 4096, 2048, 2048, seed=block, block=block)
    out = moe_w8a8.moe_experts_w8a8(x, weights, ids, *ws, swiglu_limit=LIMIT)
    ref = moe_w8a8.moe_experts_w8a8_ref(x, weights, ids, *ws, swiglu_limit=LIMIT)
    assert rel_err(out, ref) < 6e-3
    op = moe_w8a8.W8A8MoeExperts()
    early = op.quantize_input(x, *ws)
    assert early is not None
    assert torch.equal(op(x, weights, ids, *ws, swiglu_limit=LIMIT, x_fp8=early), out)
