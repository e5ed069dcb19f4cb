"""The models on the kernel registry: whole-model logits and greedy continuations, fused vs reference.

Two copies of a tiny model with the same random weights, one built with every op on the torch
reference (`KernelConfig.uniform("ref")`), one with every op on Triton (on CPU: the interpreter,
see conftest.py). A prompt longer than the window (so CSA/HCA entries and indexer picks exist) is
prefilled as two requests of one ragged call, then each model continues greedily from its own
tokens. Logits must agree within the dtype's tolerance; greedy tokens must agree until a step whose
reference top-2 margin is a near-tie, where the split is reported and the comparison stops.
"""

import json
from importlib import resources

import pytest
import torch

from dspark.api import init_model
from dspark.kernels import KernelConfig, triton_available

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


def greedy(model, prompts: list[torch.Tensor], steps: int):
    """Prefill `prompts` in one ragged call, then `steps` greedy decode calls over all requests.
    Returns (logits per call [N, V], tokens [B, steps])."""
    states = [model.new_state() for _ in prompts]
    out = model(torch.cat(prompts).to(model.device), states, [len(p) for p in prompts])
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    logits, tokens = [out.logits], []
    last = out.logits[ends.to(out.logits.device)]
    for _ in range(steps):
        nxt = last.argmax(-1)
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


def prompts(vocab: int, lengths=(13, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 2, (n,), generator=g) for n in lengths]


# bf16 runs only on the GPU: the CPU interpreter truncates fp32 -> bf16 casts (the GPU rounds to
# nearest), a bias that flips top-k routing decisions in a random tiny model.
@needs_triton
def test_v4_fused_matches_reference():
    config = three_layer_v4()
    fused, ref = build(config, "triton", torch.float32), build(config, "ref", torch.float32)
    assert fused.layers[0].fused_mhc and fused.layers[0].ffn.fused
    assert not ref.layers[0].fused_mhc and not ref.layers[0].ffn.fused
    compare(fused, ref, torch.float32, prompts(config["vocab_size"], lengths=(11, 5)), steps=3)


@needs_triton
def test_v41_fused_matches_reference():
    config = tiny_config("tiny-v41.json")
    options = dict(prefill_mode="exact", cache_qat=False)
    fused, ref = build(config, "triton", torch.float32, **options), build(config, "ref", torch.float32, **options)
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


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v4-mini", "tiny-v41"])
def test_fused_matches_reference_on_gpu(family, capsys):
    """Real sizes on the GPU (v4-mini from shared/bench, bf16): logits and greedy continuations,
    printing the logit margin of any greedy split."""
    from pathlib import Path

    if family == "v4-mini":
        path = Path(__file__).resolve().parents[2] / "shared" / "bench" / "v4-mini.json"
        path = path if path.is_file() else Path("/work/shared/bench/v4-mini.json")
        if not path.is_file():
            pytest.skip("shared/bench/v4-mini.json not found")
        config, options = json.loads(path.read_text()), {}
    else:
        config, options = tiny_config("tiny-v41.json"), dict(prefill_mode="exact")
    fused, ref = build(config, "triton", torch.bfloat16, "cuda", **options), build(config, "ref", torch.bfloat16,
                                                                                   "cuda", **options)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    # Looser than one op's bound: a rounding-level change may flip one token's expert choice.
    report = compare(fused, ref, torch.bfloat16, prompts(vocab, lengths=(300, 37)), steps=16, tol=0.1)
    with capsys.disabled():
        print(f"\n{family}: {report}")
