"""Tiny random transformers causal LMs (Llama, Qwen3, Gemma-3 with sliding layers), built from configs."""

import pytest
import torch


def tiny_hf(family: str, vocab: int = 64, seed: int = 0):
    """A randomly initialised transformers causal LM of `family`, built from a config (no download)."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **common)).eval()
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=3, head_dim=8, **common)).eval()
    if family == "gemma3":  # a sliding window shorter than the sequences, mixed with a global layer
        layers = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        return Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=4, head_dim=8, sliding_window=4,
                                                  layer_types=layers, **common)).eval()
    raise ValueError(family)


@pytest.fixture(scope="session")
def make_tiny_hf():
    """The `tiny_hf(family, vocab=64, seed=0)` factory."""
    return tiny_hf


@pytest.fixture(scope="session")
def hf_targets():
    """family -> dspark target wrapping a tiny random model of that family (built once per session)."""
    import dspark

    return {family: dspark.load_model(tiny_hf(family)) for family in ("llama", "qwen3", "gemma3")}
