"""Shared fixtures for the DeepSeek-V4 model tests: the tiny config, an HF reference, our model.

The tiny config is spec §18.1's architecture-complete one (SWA, CSA, HCA layers; hash and score
routing; both RoPE flavours; window 8 < sequence; HCA rate 8 so HCA emits entries; top-k 3 <
entries) with 16 indexer heads, so the ReLU scores have no exact ties that would let HF and us
pick different entries (spec §18.1 item 4). The HF model is randomised so that every parameter
matters (spec §18.1), then converted with `hf_keys` into our model.
"""

import copy

import pytest
import torch

from dspark.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, hf_keys

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=32,
    qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=16,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
    index_n_heads=16, index_head_dim=16, index_topk=3, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20,
    layer_types=[SWA, CSA, HCA, CSA, HCA, SWA],
    compress_rates={CSA: 4, HCA: 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                  "beta_fast": 32, "beta_slow": 1},
    # HF does not build the MTP block; our parity model leaves it out too so that loading is strict.
    num_nextn_predict_layers=0,
)


def tiny_dict(**overrides):
    d = copy.deepcopy(TINY)
    d.update(overrides)
    return d


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The ops are tiny: one thread avoids OpenMP spinning when other test processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def randomize_hf(model, seed: int) -> None:
    """Spec §18.1 sensitive init: sinks, position biases, mHC bases ~ N(0, .5), mHC scales ~ U(.5, 1.5),
    router bias ~ N(0, .1), tid2eid rows = K distinct experts; linears N(0, 1/fan_in), embedding
    N(0, 1), norm weights 1 + N(0, .1), so that every branch moves the logits."""
    g = torch.Generator().manual_seed(seed)
    n_experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], n_experts, generator=g).argsort(dim=-1)[:, : b.shape[1]])


def hf_transformers():
    """transformers with DeepSeek-V4 (5.23+), or skip the test that needs it."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("this transformers has no DeepSeek-V4 (the parity reference needs 5.23)")
    return transformers


@pytest.fixture(scope="session")
def hf_model():
    transformers = hf_transformers()
    config = transformers.DeepseekV4Config(**tiny_dict())
    model = transformers.DeepseekV4ForCausalLM(config).float().eval()
    randomize_hf(model, seed=0)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


@pytest.fixture(scope="session")
def model(hf_model):
    ours = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(tiny_dict())).eval()
    ours.load_state_dict(hf_keys.hf_to_official(hf_model.state_dict()), strict=True)
    return ours


def _random_ids(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _feed(model, state, ids: torch.Tensor):
    """One request, one call."""
    return model(ids, [state], [len(ids)])


# Helpers are handed out as fixtures: the test directories are not packages, so test modules
# cannot import from this file by name.


@pytest.fixture(scope="session")
def tiny():
    """`tiny(**overrides)`: a fresh copy of the tiny config dict."""
    return tiny_dict


@pytest.fixture(scope="session")
def random_ids():
    """`random_ids(n, seed)`: seeded LongTensor [n] of token ids < 256."""
    return _random_ids


@pytest.fixture(scope="session")
def feed():
    """`feed(model, state, ids)`: one request, one call."""
    return _feed
