"""The attention sink folded into `grouped_wo_a` inside the models (`LatentAttention.attend_and_project`).

flashinfer's attention has no sink; its op offers `unsunk` (output over the keys alone, and the
`SinkGate`), and the models hand the gate to `grouped_wo_a`, which scales each head as it loads the
output. flashinfer needs a GPU, so on the CPU a stand-in op with the same two entry points runs the
torch references (`sparse_attention_lse_ref`); the GPU test of `unsunk` itself is in
test_attention_flashinfer.py. Both tiny models and the DSpark stages, fp32: logits with the fold equal
the plain path's;
on a GPU with flashinfer, tiny-v4 at head_dim 512 with the fold against flashinfer's sink pass.
"""

import dataclasses

import pytest
import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.dspark_v4 import DSparkModel
from dspark.kernels import KernelConfig, attention_flashinfer, attention_ref, triton_available
from dspark.kernels.attention_sink import SinkGate, sparse_attention_lse_ref
from dspark.models.deepseek_v4.attention import LatentAttention

from test_draft_stage_kernels import assert_close_drafts, propose_both
from test_kernels_model import LOGIT_TOL, greedy, rel_err, tiny_config


class UnsunkRef:
    """`sparse_attention` with flashinfer's `unsunk` entry point, on the torch references; counts
    the `unsunk` calls."""

    def __init__(self):
        self.unsunk_calls = 0

    def __call__(self, q, pool, index, sink, scale):
        return attention_ref.sparse_attention_ref(q, pool, index, sink, scale)

    def unsunk(self, q, pool, index, sink, scale):
        self.unsunk_calls += 1
        out, lse = sparse_attention_lse_ref(q, pool, index, scale)
        return out, SinkGate(lse, sink, (index >= 0).sum(dim=1))


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
@pytest.mark.parametrize("wo_a", ["ref", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="triton not installed; pip install -e '.[gpu]'"))])
def test_sink_folded_into_wo_a_gives_the_models_logits(name, wo_a):
    kernels = dataclasses.replace(KernelConfig.for_device("cpu"), grouped_wo_a=wo_a)
    plain, folded = (dspark.init_model(name, seed=0, device="cpu", dtype=torch.float32, kernels=kernels)
                     for _ in range(2))
    ops = []
    for module in folded.layers.modules():  # the MTP head (unused here) keeps its op
        if isinstance(module, LatentAttention):
            module.attend_op = UnsunkRef()
            ops.append(module.attend_op)
    g = torch.Generator().manual_seed(1)
    window = plain.config.sliding_window
    prompts = [torch.randint(0, plain.config.vocab_size, (n,), generator=g) for n in (window + 9, 5)]
    forced = torch.randint(0, plain.config.vocab_size, (2, 3), generator=g)
    logits, _ = greedy(folded, prompts, 3, forced)
    expected, _ = greedy(plain, prompts, 3, forced)
    assert ops and all(op.unsunk_calls == 4 for op in ops)  # the prefill and 3 decode calls, every layer
    for got, want in zip(logits, expected):  # V4.1's bounded replay leaves the rows it skips NaN
        computed = want.isfinite().all(dim=-1)
        assert torch.equal(got.isfinite().all(dim=-1), computed) and computed.any()
        assert rel_err(got[computed], want[computed]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not attention_flashinfer.flashinfer_available(), reason="flashinfer not installed")
def test_flashinfer_models_fold_equals_its_sink_pass_on_gpu():
    """tiny-v4 at head_dim 512 (flashinfer's MLA width), bf16, every op fused, attention on flashinfer:
    with the sink folded into `grouped_wo_a` against the same model running flashinfer's sink pass
    first. The fold scales each head's fp32 sum where the pass rounds out · factor to bf16 first, so
    the two differ by that rounding: the bf16 bound of the whole-model tests (LOGIT_TOL)."""
    config = tiny_config("tiny-v4.json")
    config.update(head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    kernels = dataclasses.replace(KernelConfig.for_device("cuda"), sparse_attention="flashinfer")
    plain, folded = (dspark.init_model(config, seed=0, device="cuda", dtype=torch.bfloat16, kernels=kernels)
                     for _ in range(2))
    calls = []
    for module in plain.layers.modules():
        if isinstance(module, LatentAttention):
            module.attend_op = module.attend_op.__call__  # the bound call: no `unsunk`, so the sink pass runs
    for module in folded.layers.modules():
        if isinstance(module, LatentAttention):
            unsunk = module.attend_op.unsunk
            module.attend_op.unsunk = lambda *args, _op=unsunk: calls.append(1) or _op(*args)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (20, 5)]
    forced = torch.randint(0, 256, (2, 3), generator=g)
    logits, _ = greedy(folded, prompts, 3, forced)
    expected, _ = greedy(plain, prompts, 3, forced)
    assert len(calls) == 4 * len(folded.layers)
    assert max(rel_err(a, b) for a, b in zip(logits, expected)) < LOGIT_TOL[torch.bfloat16]


def test_draft_stages_fold_the_sink_too():
    """The DSpark stages run the same `attend_and_project` with their call's ops: a stand-in attention
    with `unsunk` in the stages gives the reference drafter's block logits and proposals."""
    target = dspark.init_model("tiny-v4", seed=0, device="cpu", dtype=torch.float32, kernels=KernelConfig())
    config = DSparkConfig.for_target(target.config, dspark_markov_rank=32)
    pair = [DSparkDrafter(target, config, DSparkModel(config, target.config, dtype=torch.float32, device="cpu",
                                                      kernels=KernelConfig()).init_weights(4).eval())
            for _ in range(2)]
    ops = []
    for stage in pair[0].model.mtp:
        chosen = stage.stage_kernels.chosen
        stage.stage_kernels.chosen = chosen._replace(attend=UnsunkRef())
        ops.append(stage.stage_kernels.chosen.attend)
    assert_close_drafts(propose_both(pair, target))
    assert ops and all(op.unsunk_calls > 0 for op in ops)
