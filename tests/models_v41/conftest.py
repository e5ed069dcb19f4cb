"""Shared fixtures for the DeepSeek-V4.1 tests: the tiny architecture-complete config and models.

The tiny config is `dspark/configs/tiny-v41.json`, spec §14.1's design: every layer role (pure
SWA 0; Full ratio 2 + Engram 1; Reuse ratio 2 2-3; Full ratio 1 + candidate source + Engram 4;
Reuse ratio 1 5; Reindex inside the candidate pool 6), window 8 < sequences of >= 41 tokens,
top-k 4 < entries, candidate pool of 2 blocks of 4 < visible entries. Deviations: 16 indexer
heads instead of 4, so that index scores have no exact ties (an all-negative ReLU row scores
exactly 0; with 4 heads that happens for 1/16 of the entries and top-k tie-breaking would then
depend on the number of entries, not on the model — deepseek_v4 spec §18.1 item 4); vocabulary
258 = bytes + bos + eos (the CLI's byte tokenizer), with the identity compressed-id table
(`engram_compressed_vocab_size` 258) since a random model has no tokenizer.
"""

import copy
import json
from importlib import resources

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dspark.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM

TINY = json.loads(resources.files("dspark.configs").joinpath("tiny-v41.json").read_text())


def tiny_dict(**text_overrides):
    """A fresh copy of the tiny composite config with `text_config` keys overridden."""
    d = copy.deepcopy(TINY)
    d["text_config"].update(text_overrides)
    return d


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny ops: one thread avoids OpenMP spinning when other test processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(seed: int = 0, prefill_mode: str = "exact", cache_qat: bool = False, **text_overrides):
    """A random tiny model. Exactness tests run without the cache QAT (`cache_qat=False`): rounding
    to the FP8/FP4 grids turns fp32 noise of a few ulps (a row computed in a batch of 13 rather
    than 60: the GEMM takes another kernel) into a whole grid step now and then, which no
    tolerance covers; the QAT path has its own tests."""
    config = DeepseekV41Config.from_dict(tiny_dict(**text_overrides))
    model = DeepseekV41ForCausalLM(config, prefill_mode=prefill_mode, cache_qat=cache_qat)
    return model.init_weights(seed).eval()


def _random_ids(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _feed(model, state, ids: torch.Tensor, **kwargs):
    """One request, one call."""
    return model(ids, [state], [len(ids)], **kwargs)


@pytest.fixture(scope="session")
def model():
    """The tiny model in exact prefill mode (the reference), without cache QAT, seed 0."""
    return build(seed=0)


# Helpers are handed out as fixtures: the test directories are not packages.


@pytest.fixture(scope="session")
def tiny():
    """`tiny(**text_overrides)`: a fresh copy of the tiny composite config dict."""
    return tiny_dict


@pytest.fixture(scope="session")
def make_model():
    """`make_model(seed=0, prefill_mode="exact", cache_qat=False, **text_overrides)`: a random tiny model."""
    return build


@pytest.fixture(scope="session")
def random_ids():
    """`random_ids(n, seed)`: seeded LongTensor [n] of byte token ids."""
    return _random_ids


@pytest.fixture(scope="session")
def feed():
    """`feed(model, state, ids, **kwargs)`: one request, one call."""
    return _feed


def _released_config() -> dict:
    """The released composite `config.json` of V4.1-Flash, as spec §2.1 lists it."""
    text = dict(
        model_type="deepseek_v41_text", vocab_size=129280, hidden_size=5120, num_hidden_layers=40,
        moe_intermediate_size=2304, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, hidden_act="silu",
        swiglu_limit=10.0, rms_norm_eps=1e-20, initializer_range=0.02, attention_bias=False,
        attention_dropout=0.0, tie_word_embeddings=False, max_position_embeddings=1048576, rope_theta=10000,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        compress_rope_theta=160000, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6,
        scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
        sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        index_n_heads=32, index_head_dim=128, index_topk=512, candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
        engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2,
        engram_compressed_vocab_size=99092, num_nextn_predict_layers=3, dspark_block_size=5,
        dspark_noise_token_id=128799, dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256,
        dspark_n_routed_experts=128, dspark_num_experts_per_tok=3,
    )
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "transformers_version": "5.6.0", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024},
    }


def _bpe_tokenizer() -> Tokenizer:
    """A tiny BPE trained on a few strings that differ in case, accents and spacing."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<s>", "<pad>"], show_progress=False)
    corpus = ["Hello world", "hello World", "HELLO WORLD", "héllo wörld café", "Cafe CAFE cafe", "the The THE"]
    tokenizer.train_from_iterator(corpus * 5, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def released_config():
    """`released_config()`: the released V4.1-Flash composite config.json (spec §2.1) as a dict."""
    return _released_config


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """`bpe_tokenizer()`: a tiny BPE `tokenizers.Tokenizer` trained on case / accent variants."""
    return _bpe_tokenizer
