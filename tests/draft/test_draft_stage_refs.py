"""The DSpark stages on the kernel registry, CPU side (the Triton-vs-reference comparison runs under
the interpreter in tests/kernels/test_draft_stage_kernels.py).

(1) With the torch references a V4 stage computes exactly its former torch code (the `hc_pre` /
`hc_post` / `sparse_attention_ref` / einsum dataflow), bit for bit. (2) The drafter takes the kernel
choice of its target. (3) Training keeps the references: a drafter configured with every op on
Triton trains (loss, gradients, the whole `train_draft` history) exactly like a reference drafter,
because under autograd the stages run the references (`dspark.draft.stage_kernels`); without that
rule the Triton kernels would run on CPU tensors outside the interpreter and fail, or drop the
gradients.
"""

import dataclasses

import pytest
import torch

import dspark
from draft_targets import tiny_v4_config
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.dspark_v4 import DSparkModel, target_kernels
from dspark.draft.stages import block_index
from dspark.kernels import KernelConfig, mhc, triton_available
from dspark.kernels.attention_ref import sparse_attention_ref
from dspark.models.deepseek_v4.mhc import hc_post, hc_pre
from dspark.models.deepseek_v4.norm import rms_scale
from dspark.models.deepseek_v4.rope import apply_rope
from dspark.train.anchors import build_blocks
from dspark.train.data import TrainingSequence
from dspark.train.losses import LossWeights
from dspark.train.trainer import TrainConfig, block_losses, train_draft

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
TRITON = KernelConfig.uniform("triton")


@pytest.fixture(scope="module")
def dspark_config(tiny):
    return DSparkConfig.for_target(tiny.config, dspark_markov_rank=32)


def _former_stage_forward(stage, x, ids, positions, ctx_pool, ctx_index, gamma):
    """The stage's torch code before it used the registry (kept here as the bit-exact reference)."""
    def pre(x, fn, base, scale):
        return hc_pre(x, fn, base, scale, stage.n_hc, stage.sinkhorn_iters, stage.hc_eps, stage.norm_eps)

    def attend(h):
        attn, n = stage.attn, h.shape[0]
        cos, sin = attn.rope.cos_sin(positions)
        q = attn.wq_b(attn.q_norm(attn.wq_a(h))).unflatten(-1, (attn.n_heads, attn.head_dim))
        q = apply_rope(rms_scale(q, attn.eps).to(h.dtype), cos.unsqueeze(-2), sin.unsqueeze(-2))
        kv = apply_rope(attn.kv_norm(attn.wkv(h)), cos, sin)
        pool = torch.cat((ctx_pool.to(kv.dtype), kv))
        index = torch.cat((ctx_index, block_index(n, gamma, ctx_pool.shape[0], h.device)), dim=-1)
        out = sparse_attention_ref(q, pool, index, attn.attn_sink, attn.scale)
        out = apply_rope(out, cos.unsqueeze(-2), -sin.unsqueeze(-2))
        weight = attn.wo_a.weight.view(attn.o_groups, attn.o_lora_rank, -1)
        return attn.wo_b(torch.einsum("ngk,grk->ngr", out.reshape(n, attn.o_groups, -1), weight).flatten(1))

    u, post, comb = pre(x, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale)
    x = hc_post(attend(stage.attn_norm(u)), x, post, comb)
    v, post, comb = pre(x, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale)
    return hc_post(stage.ffn(stage.ffn_norm(v), ids), x, post, comb)


@pytest.mark.parametrize("grad", [False, True])
def test_reference_stage_is_its_former_torch_code_bit_for_bit(tiny, dspark_config, grad):
    model = DSparkModel(dspark_config, tiny.config, kernels=KernelConfig()).init_weights(2)
    stage, gamma, d = model.mtp[1], dspark_config.dspark_block_size, tiny.config.hidden_size
    g = torch.Generator().manual_seed(0)
    n, ctx = 2 * gamma, 7
    x = torch.randn(n, model.n_hc, d, generator=g)
    ids = torch.randint(0, 256, (n,), generator=g)
    positions = torch.arange(n) + ctx
    pool = torch.randn(ctx, model.head_dim, generator=g)
    ctx_index = torch.where(torch.rand(n, model.window, generator=g) < 0.8,
                            torch.randint(0, ctx, (n, model.window), generator=g), -1)
    with torch.set_grad_enabled(grad):
        got = stage(x, ids, positions, pool, ctx_index, gamma)
        want = _former_stage_forward(stage, x, ids, positions, pool, ctx_index, gamma)
    assert torch.equal(got, want)


@needs_triton
def test_drafter_takes_the_kernel_choice_of_its_target(dspark_config):
    target = dspark.init_model(tiny_v4_config(), seed=0, kernels=dataclasses.replace(KernelConfig(), mhc_pre="triton"))
    model = DSparkDrafter(target, dspark_config).model
    assert model.kernels == target.kernels == target_kernels(target)
    ops = model.mtp[0].stage_kernels
    assert ops.chosen.pre is mhc.mhc_pre and ops.chosen.post is mhc.mhc_post_ref and not ops.chosen.reference
    with torch.no_grad():
        assert ops.current() is ops.chosen
    assert ops.current() is ops.references and ops.references.pre is mhc.mhc_pre_ref
    assert target_kernels(object()) is None  # a target without a choice: DSparkModel's device default
    assert DSparkModel(dspark_config, target.config).kernels == KernelConfig.for_device("cpu")


@needs_triton
def test_training_a_triton_configured_drafter_runs_the_references(tiny, dspark_config):
    drafters = [DSparkDrafter(tiny, dspark_config, DSparkModel(dspark_config, tiny.config, kernels=k).init_weights(3))
                for k in (TRITON, KernelConfig())]
    assert drafters[0].model.mtp[0].ffn.fused  # its inference path is Triton throughout
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    blocks = build_blocks(ids, torch.ones_like(ids), torch.tensor([1, 8, 15]), dspark_config.dspark_block_size,
                          dspark_config.dspark_noise_token_id)
    losses, grads = [], []
    for drafter in drafters:
        drafter.model.train().requires_grad_(True)
        loss, _ = block_losses(drafter, ids, blocks, LossWeights(), float(blocks.weights.sum()))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in drafter.model.parameters()])
    assert torch.equal(losses[0], losses[1])
    assert all(a is not None and torch.equal(a, b) for a, b in zip(*grads) if b is not None)
    # and the training loop itself: two steps, the same history
    data = [TrainingSequence(tuple(ids.tolist()), (1,) * len(ids))]
    config = TrainConfig(steps=2, num_anchors=3, lr=3e-3, seed=7, progress=False)
    histories = [train_draft(tiny, data, config, drafter=d).history for d in drafters]
    assert histories[0] == histories[1]
