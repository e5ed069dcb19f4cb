"""The models on the kernel registry: whole-model logits and greedy continuations, fused vs reference.

Two copies of a tiny model with the same random weights, one built with every op on the torch
reference (`KernelConfig.uniform("ref")`), one with every op on Triton (on CPU: the interpreter,
see conftest.py). A prompt longer than the window (so CSA/HCA entries and indexer picks exist) is
prefilled as two requests of one ragged call, then each model continues greedily from its own
tokens. Logits must agree within the dtype's tolerance; greedy tokens must agree until a step whose
reference top-2 margin is a near-tie, where the split is reported and the comparison stops.

In bf16 a random tiny model is chaotic: any single op's rounding can flip a near-tied routing or
indexer choice and move logits by whole units, so fused-vs-reference in bf16 says little. The bf16
GPU test instead measures both bf16 models against an fp32 reference holding the same weights
(METHOD.md: compare with higher precision) and requires the fused model's error to stay within a
small factor of the bf16 reference's own error; greedy splits from the fp32 run are reported with
the fp32 top-2 margin where they happen.
"""

import json
from importlib import resources

import pytest
import torch

from dspark.api import init_model
from dspark.kernels import (KernelConfig, compressor, indexer, indexer_pool, indexer_ref, mhc_norm, mhc_v41, rms_norm,
                            rope, triton_available)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGIT_TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}  # ‖Δ‖/‖ref‖ after the whole stack
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.15}  # top-2 logit gap under which greedy may split


def tiny_config(name: str) -> dict:
    return json.loads(resources.files("dspark.configs").joinpath(name).read_text())


def three_layer_v4() -> dict:
    """tiny-v4 cut to SWA (hash MoE), CSA, HCA layers: every attention kind and both routings,
    at half the interpreter time of the six-layer model."""
    config = tiny_config("tiny-v4.json")
    config.update(num_hidden_layers=3, num_nextn_predict_layers=0,
                  layer_types=config["layer_types"][:3], mlp_layer_types=["hash_moe", "moe", "moe"])
    return config


def build(config: dict, impl: str, dtype: torch.dtype, device: str = DEVICE, **options):
    return init_model(config, seed=3, device=device, dtype=dtype, kernels=KernelConfig.uniform(impl), **options)


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "non-finite logits"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def greedy(model, prompts: list[torch.Tensor], steps: int, forced: torch.Tensor | None = None):
    """Prefill `prompts` in one ragged call, then `steps` greedy decode calls over all requests
    (or, with `forced` [B, steps], decode those tokens: teacher forcing).
    Returns (logits per call [N, V], tokens [B, steps])."""
    states = [model.new_state() for _ in prompts]
    out = model(torch.cat(prompts).to(model.device), states, [len(p) for p in prompts])
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    logits, tokens = [out.logits], []
    last = out.logits[ends.to(out.logits.device)]
    for i in range(steps):
        nxt = last.argmax(-1) if forced is None else forced[:, i].to(last.device)
        tokens.append(nxt)
        out = model(nxt, states, [1] * len(prompts))
        logits.append(out.logits)
        last = out.logits
    return logits, torch.stack(tokens, dim=1)


def compare(fused_model, ref_model, dtype, prompts, steps, tol=None) -> dict:
    """Logit agreement and the greedy comparison (see the module docstring); returns a report with
    the largest logit error and, per greedy split, the reference's top-2 margin there."""
    tol = LOGIT_TOL[dtype] if tol is None else tol
    fused_logits, fused_tokens = greedy(fused_model, prompts, steps)
    ref_logits, ref_tokens = greedy(ref_model, prompts, steps)
    last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    errors = [rel_err(fused_logits[0], ref_logits[0])]
    report = {"max_rel_err": errors[0], "splits": []}
    for b in range(len(prompts)):
        differ = (fused_tokens[b] != ref_tokens[b]).nonzero()
        split = int(differ[0]) if len(differ) else steps
        # Decode call i consumed tokens 0..i-1, equal in both runs up to the split.
        errors += [rel_err(fused_logits[i][b], ref_logits[i][b]) for i in range(1, split + 1)]
        if split < steps:  # token `split` came from prefill's last row (split 0) or decode call `split`
            chooser = ref_logits[0][last_rows[b]] if split == 0 else ref_logits[split][b]
            top2 = chooser.float().topk(2).values
            report["splits"].append({"request": b, "step": split, "margin": (top2[0] - top2[1]).item()})
    report["max_rel_err"] = max(errors)
    assert report["max_rel_err"] < tol, report
    assert all(s["margin"] < NEAR_TIE[dtype] for s in report["splits"]), report
    return report


def first_splits(tokens: torch.Tensor, ref_tokens: torch.Tensor, ref_logits, prompts) -> list[dict]:
    """Per request, the first greedy step where `tokens` leave `ref_tokens` [B, steps], with the
    reference's top-2 logit margin at that step (its logits there follow the common prefix)."""
    last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    splits = []
    for b in range(tokens.shape[0]):
        differ = (tokens[b] != ref_tokens[b]).nonzero()
        if len(differ):
            step = int(differ[0])
            chooser = ref_logits[0][last_rows[b]] if step == 0 else ref_logits[step][b]
            top2 = chooser.float().topk(2).values
            splits.append({"request": b, "step": step, "margin": (top2[0] - top2[1]).item()})
    return splits


def compare_to_fp32(fused_model, ref_model, fp32_model, prompts, steps, factor) -> dict:
    """bf16 fused and bf16 reference models, both against the fp32 reference on its own greedy
    tokens (teacher-forced, so every call's logits are comparable): the fused model's relative
    error over all calls must be at most `factor` × the bf16 reference's. Greedy splits of each
    bf16 model from the fp32 run are reported with the fp32 margin there."""
    exact_logits, exact_tokens = greedy(fp32_model, prompts, steps)
    exact = torch.cat(exact_logits).double()
    report = {}
    for name, model in (("fused", fused_model), ("ref", ref_model)):
        forced_logits, _ = greedy(model, prompts, steps, forced=exact_tokens)
        _, tokens = greedy(model, prompts, steps)
        report[f"{name}_rel_err"] = rel_err(torch.cat(forced_logits), exact)
        report[f"{name}_splits"] = first_splits(tokens.cpu(), exact_tokens.cpu(), exact_logits, prompts)
    report["ratio"] = report["fused_rel_err"] / max(report["ref_rel_err"], 1e-12)
    assert report["fused_rel_err"] <= factor * report["ref_rel_err"], report
    return report


def bf16_and_fp32(config, options, device):
    """(fused bf16, reference bf16, reference fp32) with identical weights: the fp32 copy loads the
    bf16 model's values, so it computes the same function in higher precision."""
    fused = build(config, "triton", torch.bfloat16, device, **options)
    ref = build(config, "ref", torch.bfloat16, device, **options)
    exact = build(config, "ref", torch.float32, device, **options)
    exact.load_state_dict(ref.state_dict())  # upcast on copy
    return fused, ref, exact


def prompts(vocab: int, lengths=(13, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 2, (n,), generator=g) for n in lengths]


# bf16 runs only on the GPU: the CPU interpreter truncates fp32 -> bf16 casts (the GPU rounds to
# nearest), a bias that flips top-k routing decisions in a random tiny model.
@needs_triton
def test_v4_fused_matches_reference():
    config = three_layer_v4()
    fused, ref = build(config, "triton", torch.float32), build(config, "ref", torch.float32)
    assert fused.layers[0].post_pre_op is mhc_norm.mhc_post_pre_norm and fused.layers[0].ffn.fused
    assert not ref.layers[0].ffn.fused  # (its sites: the unfused pair, tests/kernels/test_mhc_norm.py)
    assert fused.layers[1].attn.indexer.select_op is indexer.lightning_indexer
    assert ref.layers[1].attn.indexer.select_op is indexer_ref.lightning_indexer_ref
    assert fused.layers[2].attn.compressor.pool_op is compressor.compressor_pool  # HCA
    assert fused.layers[1].attn.indexer.compressor.pool_op is compressor.compressor_pool
    assert fused.layers[1].attn.q_norm.norm_op is rms_norm.rms_norm and fused.norm.norm_op is rms_norm.rms_norm
    assert fused.layers[1].attn.rope_op is rope.rope and fused.layers[1].attn.indexer.rope_op is rope.rope
    assert ref.layers[1].attn.rope_op is rope.rope_ref and ref.layers[1].attn.kv_norm.norm_op is rms_norm.rms_norm_ref
    compare(fused, ref, torch.float32, prompts(config["vocab_size"], lengths=(11, 5)), steps=3)


@needs_triton
def test_v41_fused_matches_reference():
    config = tiny_config("tiny-v41.json")
    options = dict(prefill_mode="exact", cache_qat=False)
    fused, ref = build(config, "triton", torch.float32, **options), build(config, "ref", torch.float32, **options)
    reindex = fused.layers[6].attn.indexer  # candidate consumer: the pool is fused into its top-k
    assert reindex.uses_candidates and reindex.select_op is indexer.lightning_indexer
    assert fused.layers[1].attn.compressor.pool_op is compressor.compressor_pool  # ratio-2 KV source
    source = fused.layers[config["text_config"]["candidate_source_layer_id"]].attn.indexer
    assert source.is_candidate_source and source.pool_op is indexer_pool.indexer_pool
    assert fused.layers[0].pre_op is mhc_v41.mhc_v41_pre and fused.layers[0].post_pre_op is mhc_v41.mhc_v41_post_pre
    assert ref.layers[0].pre_op is mhc_v41.mhc_v41_pre_ref
    assert fused.layers[1].attn.compressor.norm.norm_op is rms_norm.rms_norm and fused.layers[1].attn.rope_op is rope.rope
    compare(fused, ref, torch.float32, prompts(config["text_config"]["vocab_size"], lengths=(11, 5)), steps=2)


def test_kernels_option_is_validated_and_defaults_to_device():
    config = tiny_config("tiny-v4.json")
    model = init_model(config, device="cpu")
    assert model.kernels == KernelConfig.for_device("cpu") == KernelConfig.uniform("ref")
    with pytest.raises(ValueError, match="kernels"):
        init_model(config, device="cpu", kernels="triton")


def test_moe_experts_alias_stacked_weights():
    """The fused MoE reads stacked expert weights that are the per-expert parameters themselves;
    after a conversion that replaces the parameters, they are stacked again (never stale)."""
    model = init_model(tiny_config("tiny-v4.json"), device="cpu")
    moe = model.layers[2].ffn
    w1, w2, w3 = moe.stacked_weights()
    assert torch.equal(w1[5], moe.experts[5].w1.weight) and w1[5].data_ptr() == moe.experts[5].w1.weight.data_ptr()
    with torch.no_grad():
        moe.experts[5].w2.weight.mul_(2)  # an in-place update shows in the stack
    assert torch.equal(moe.stacked_weights()[1][5], moe.experts[5].w2.weight)
    moe.to(torch.float64)  # replaces every parameter
    w1, _, _ = moe.stacked_weights()
    assert w1.dtype == torch.float64 and torch.equal(w1[7], moe.experts[7].w1.weight)


def test_bf16_comparison_against_fp32_on_cpu():
    """The bf16 machinery on the references (CPU, no interpreter): a second bf16 reference as the
    'fused' model has exactly the reference's error (ratio 1), which is > 0 but small; a model with
    other weights fails the bound."""
    config = three_layer_v4()
    fused, ref, exact = bf16_and_fp32(config, {}, "cpu")
    fused = build(config, "ref", torch.bfloat16, "cpu")
    batch = prompts(config["vocab_size"], lengths=(11, 5))
    report = compare_to_fp32(fused, ref, exact, batch, steps=2, factor=1.0)
    assert report["ratio"] == 1.0 and 0 < report["ref_rel_err"] < 0.1
    other = init_model(config, seed=4, device="cpu", dtype=torch.bfloat16, kernels=KernelConfig.uniform("ref"))
    with pytest.raises(AssertionError):
        compare_to_fp32(other, ref, exact, batch, steps=2, factor=3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v4-mini", "tiny-v41"])
def test_fused_matches_reference_on_gpu(family, capsys):
    """Real sizes on the GPU (v4-mini, tiny-v41; bf16): the fused model's logit error against the
    fp32 reference within 2x the bf16 reference's own error, over a prefill and 16 greedy steps;
    prints both errors and every greedy split with the fp32 margin there."""
    if family == "v4-mini":
        config, options = tiny_config("v4-mini.json"), {}
    else:
        config, options = tiny_config("tiny-v41.json"), dict(prefill_mode="exact")
    fused, ref, exact = bf16_and_fp32(config, options, "cuda")
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    report = compare_to_fp32(fused, ref, exact, prompts(vocab, lengths=(300, 37)), steps=16, factor=2.0)
    with capsys.disabled():
        print(f"\n{family}: {report}")
