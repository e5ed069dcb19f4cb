"""transformers `save_pretrained` directories load into our model and reproduce HF's logits."""

import json
from importlib import resources

import pytest
import torch

import dspark.api as api

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4 (5.23.0 is the reference)", allow_module_level=True)


def tiny_config():
    return json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())


def randomise_(hf_model, seed):
    """Make every parameter matter (spec §18.1): HF initialises sinks, biases, mHC and norms to
    constants and `tid2eid` to zeros (every token to expert 0 twice)."""
    g = torch.Generator().manual_seed(seed)
    k, n_experts = hf_model.config.num_experts_per_tok, hf_model.config.n_routed_experts
    with torch.no_grad():
        for name, tensor in hf_model.state_dict(keep_vars=True).items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                tensor.copy_(torch.rand(tensor.shape[0], n_experts, generator=g).argsort(-1)[:, :k])
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.5)
            elif leaf in ("scale", "hc_scale"):
                tensor.copy_(torch.rand(tensor.shape, generator=g) + 0.5)
            elif leaf == "e_score_correction_bias":
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.1)
            elif "norm" in name:
                tensor.copy_(1 + torch.randn(tensor.shape, generator=g) * 0.1)
            elif leaf in ("fn", "hc_fn"):
                tensor.copy_(torch.randn(tensor.shape, generator=g) * tensor.shape[-1] ** -0.5)
    return hf_model


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**tiny_config())
    return randomise_(transformers.DeepseekV4ForCausalLM(config).float().eval(), seed=1)


@pytest.mark.parametrize("save_original_format", [True, False], ids=["hf_saved", "hf_names"])
def test_save_pretrained_loads_with_hf_logits(hf_model, tmp_path, save_original_format):
    hf_model.save_pretrained(tmp_path, save_original_format=save_original_format)
    model = api.load_model(tmp_path)
    # transformers drops the MTP block: ours stays randomly initialised and says so.
    assert model.has_mtp is False
    ids = torch.randint(0, hf_model.config.vocab_size, (41,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(input_ids=ids[None]).logits[0].float()
    ours = model(ids, [model.new_state()], [len(ids)]).logits
    assert (ours - expected).abs().max().item() <= 1e-4
