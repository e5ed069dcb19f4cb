"""The DSpark draft stages on the kernel registry: Triton (on CPU: the interpreter, see conftest.py)
against the torch references, for V4 stages and the V4.1 shipped stages.

One tiny target (torch references) gives the features; two copies of one drafter with the same
random weights draft from them, one built with every op on the reference, one with every op on
Triton. Proposals run without gradients (the rule of `dspark.draft.stage_kernels`), so the Triton
copy runs the fused mHC sites, the sparse-attention core, the grouped `wo_a`, the fused MoE and the
fused RMSNorm and RoPE.
"""

import copy
import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.dspark_v4 import DSparkModel
from dspark.draft.io import v41_dspark_config
from dspark.kernels import KernelConfig, attention, grouped_wo_a, mhc, mhc_v41, rms_norm, rope, triton_available
from dspark.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = 1e-3  # ‖Δ‖/‖ref‖ of fp32 draft logits, as the whole-model fp32 test (test_kernels_model.py)
V41_DSPARK = dict(dspark_block_size=5, dspark_noise_token_id=257, dspark_target_layer_ids=[4, 5, 6],
                  dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)


def tiny_config(name: str) -> dict:
    return json.loads(resources.files("dspark.configs").joinpath(name).read_text())


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def drafter_pair(target, config, **model_options):
    """(Triton drafter, reference drafter) of `target` with equal weights."""
    def make(impl):
        model = DSparkModel(config, target.config, dtype=target.dtype, device=target.device,
                            kernels=KernelConfig.uniform(impl), **model_options).init_weights(4).eval()
        return DSparkDrafter(target, config, model)
    return make("triton"), make("ref")


def propose_both(pair, target, n_ids=24):
    """Observe one prompt (as two requests, one cut short), then propose greedily with each drafter."""
    ids = torch.randint(0, 256, (n_ids,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    proposals = []
    for drafter in pair:
        out = target(ids, [target.new_state()], [n_ids], capture_layers=drafter.capture_layers)
        states = [drafter.new_state(), drafter.new_state()]
        drafter.observe(states[0], ids, out.hidden, out.features)
        drafter.observe(states[1], ids[:9], out.hidden[:9], {i: f[:9] for i, f in out.features.items()})
        with torch.no_grad():  # under autograd the stages would run the references
            block = drafter.block_logits(states, [7, 9]).out
        proposal = drafter.propose(states, [7, 9], dspark.SamplingParams(temperature=0.0),
                                   [torch.Generator(DEVICE).manual_seed(0) for _ in states])
        proposals.append((block, proposal))
    return proposals


def assert_close_drafts(proposals):
    (fused, fused_prop), (ref, ref_prop) = proposals
    errors = [rel_err(fused.base, ref.base), rel_err(fused.hidden_pre, ref.hidden_pre),
              rel_err(fused_prop.confidence_logits, ref_prop.confidence_logits)]
    assert max(errors) < REL_TOL
    top2 = ref.base.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1e-3).all()  # no near-tie: greedy tokens must agree
    assert torch.equal(fused_prop.tokens, ref_prop.tokens)


@needs_triton
def test_v4_stages_on_triton_match_the_references():
    # fp32 on every device (init_model's CUDA default is bf16, whose rounding the fp32 tolerance does not allow)
    target = dspark.init_model(tiny_config("tiny-v4.json"), seed=0, device=DEVICE, dtype=torch.float32,
                               kernels=KernelConfig())
    pair = drafter_pair(target, DSparkConfig.for_target(target.config, dspark_markov_rank=32))
    chosen = pair[0].model.mtp[0].stage_kernels.chosen
    assert (chosen.pre, chosen.post_pre, chosen.post) == (mhc.mhc_pre, mhc.mhc_post_pre, mhc.mhc_post)
    assert (chosen.attend, chosen.wo_a) == (attention.sparse_attention, grouped_wo_a.grouped_wo_a)
    assert pair[0].model.mtp[0].ffn.fused and not pair[1].model.mtp[0].ffn.fused
    stage = pair[0].model.mtp[0]
    assert stage.main_norm.norm_op is stage.attn.norm_op is rms_norm.rms_norm and stage.attn.rope_op is rope.rope
    assert pair[1].model.mtp[0].attn.rope_op is rope.rope_ref
    assert_close_drafts(propose_both(pair, target))


@needs_triton
def test_v41_shipped_stages_on_triton_match_the_references():
    config = copy.deepcopy(tiny_config("tiny-v41.json"))
    config["text_config"].update(V41_DSPARK)
    target = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(config), prefill_mode="exact", cache_qat=False,
                                    device=DEVICE, kernels=KernelConfig()).init_weights(3).eval()
    pair = drafter_pair(target, v41_dspark_config(target.config), stage_kind="shipped", cache_qat=False)
    chosen = pair[0].model.mtp[0].stage_kernels.chosen
    assert (chosen.pre, chosen.post_pre) == (mhc_v41.mhc_v41_pre, mhc_v41.mhc_v41_post_pre)
    assert_close_drafts(propose_both(pair, target))
