"""`HFCausalLM`: a transformers causal LM as a dspark target.

Ragged calls reproduce the model's own full forward, rollback is exact, speculative decoding is
exact (greedy identity with n-gram and DSpark drafters; χ² against exact enumeration when sampling),
and models whose state cannot be rewound are refused with the reason.
"""

import pytest
import torch
from scipy.stats import chisquare

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter, NgramDrafter
from dspark.models.hf_causal import HFCausalLM, check_rewindable

FAMILIES = ("llama", "qwen3", "gemma3")


def _seq(n, seed, vocab=64):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_calls_match_the_full_forward(hf_targets, family):
    target = hf_targets[family]
    a, b = _seq(19, 1), _seq(11, 2)
    ref_a, ref_b = (target.hf(s[None]).logits[0] for s in (a, b))
    sa, sb = target.new_state(), target.new_state()
    first = target(torch.cat([a[:6], b[:9]]), [sa, sb], [6, 9])
    second = target(torch.cat([a[6:], b[9:]]), [sa, sb], [13, 2], capture_layers=(0, 2, 3))
    torch.testing.assert_close(torch.cat([first.logits[:6], second.logits[:13]]), ref_a, rtol=0, atol=2e-6)
    torch.testing.assert_close(torch.cat([first.logits[6:], second.logits[13:]]), ref_b, rtol=0, atol=2e-6)
    assert (sa.length, sb.length) == (19, 11) and sa.token_ids.tolist() == a.tolist()
    # Feature id ℓ is the input of decoder layer ℓ: HF's hidden_states[ℓ] for ℓ < L.
    states = target.hf(a[None], output_hidden_states=True).hidden_states
    assert second.features[0].shape == (15, 1, 32) and set(second.features) == {0, 2, 3}
    torch.testing.assert_close(second.features[2][:13, 0], states[2][0, 6:], rtol=0, atol=2e-6)
    assert second.hidden.shape == (15, 1, 32)


@pytest.mark.parametrize("family", FAMILIES)
def test_truncate_restores_the_kept_prefix_exactly(hf_targets, family):
    target = hf_targets[family]
    seq = _seq(16, 3)
    state = target.new_state()
    target(seq[:9], [state], [9])
    target(seq[9:], [state], [7])  # a verify block of 7 rows
    computed = state.snapshot()
    state.truncate(12)  # keep anchor + 2 accepted drafts
    kept = state.snapshot()
    assert kept["length"] == 12 and kept["tokens"].tolist() == seq[:12].tolist()
    for key, value in kept.items():
        if key.startswith("layers."):  # bit-identical to the first rows the verify call wrote
            assert torch.equal(value, computed[key][..., :12, :]), key
    fresh = target.new_state()
    target(seq[:12], [fresh], [12])
    for key, value in fresh.snapshot().items():
        if key.startswith("layers."):
            torch.testing.assert_close(kept[key], value, rtol=0, atol=2e-6)
    nxt = torch.tensor([5, 6, 7])
    torch.testing.assert_close(target(nxt, [state], [3]).logits, target(nxt, [fresh], [3]).logits,
                               rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="n_keep=16 outside"):
        state.truncate(16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        motif = torch.randint(0, 64, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        out.append(motif * int(torch.randint(2, 4, (1,), generator=g)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_plain(hf_targets, prompts, family):
    target = hf_targets[family]
    plain = [o.token_ids for o in dspark.generate(target, prompts, max_new_tokens=20)]
    dspark_drafter = DSparkDrafter(target, DSparkConfig.for_target(target.config, dspark_markov_rank=16))
    for drafter, budgets in ((NgramDrafter(block_size=5), (2, 5)), (dspark_drafter.init_weights(0), (7, "auto"))):
        for budget in budgets:
            outs = dspark.generate(target, prompts, max_new_tokens=20, draft_tokens=budget, drafter=drafter)
            assert [o.token_ids for o in outs] == plain, (type(drafter).__name__, budget)
            assert sum(o.stats.verified_tokens for o in outs) > 0
    ngram = dspark.generate(target, prompts, max_new_tokens=20, draft_tokens=5, drafter=NgramDrafter(block_size=5))
    assert sum(o.stats.rejected_tokens for o in ngram) > 0
    assert sum(o.stats.verified_tokens - o.stats.rejected_tokens for o in ngram) > 0  # both paths ran


@pytest.mark.parametrize("drafter_kind", ["ngram", "dspark"])
def test_sampled_speculative_matches_target_distribution(make_tiny_hf, exact_pair_distribution, drafter_kind):
    vocab = 4
    target = dspark.load_model(make_tiny_hf("llama", vocab=vocab, seed=1))
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = dspark.SamplingParams(temperature=1.0)
    exact = exact_pair_distribution(target, prompt, vocab, params).flatten()
    if drafter_kind == "ngram":
        drafter = NgramDrafter(block_size=5)
    else:
        drafter = DSparkDrafter(target, DSparkConfig.for_target(target.config, dspark_markov_rank=4,
                                                                dspark_block_size=4)).init_weights(3)
    n = 1200
    outs = dspark.generate(target, [prompt] * n, max_new_tokens=4, temperature=1.0, seed=11,
                           draft_tokens=drafter.block_size, drafter=drafter)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1] * vocab + o.token_ids[2]] += 1
    assert sum(o.stats.verified_tokens - o.stats.rejected_tokens for o in outs) > 0
    assert sum(o.stats.rejected_tokens for o in outs) > 0
    keep = exact > 0
    assert counts[~keep].sum() == 0
    p = chisquare(counts[keep].numpy(), (exact[keep] / exact[keep].sum() * n).numpy()).pvalue
    print(f"{drafter_kind}: chi-square p = {p:.3f}")
    assert p > 1e-3


def test_dspark_defaults_follow_the_offline_setting(hf_targets):
    config = DSparkConfig.for_target(hf_targets["gemma3"].config)
    assert config.dspark_block_size == 7 and config.dspark_markov_rank == 256
    assert config.dspark_target_layer_ids == (1, 2, 3)  # all a 4-layer target has, from layer 1 on
    from dspark.models.hf_causal.config import _spread_layers

    assert _spread_layers(18, 5) == (1, 5, 9, 13, 17) and len(_spread_layers(36, 5)) == 5


def test_models_whose_state_cannot_be_rewound_are_refused(make_tiny_hf):
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=16, hidden_size=8, state_size=4, num_hidden_layers=1))
    with pytest.raises(ValueError, match="MambaForCausalLM: transformers marks this model stateful"):
        dspark.load_model(mamba)
    hybrid = make_tiny_hf("llama")
    hybrid.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer type\(s\) \['linear_attention'\]"):
        check_rewindable(hybrid)


def test_load_model_reads_a_transformers_directory(make_tiny_hf, tmp_path):
    hf = make_tiny_hf("qwen3")
    hf.save_pretrained(tmp_path)
    target = dspark.load_model(tmp_path)
    assert isinstance(target, HFCausalLM) and target.tokenizer is None and target.config.model_type == "qwen3"
    ids = _seq(10, 4)
    torch.testing.assert_close(target(ids, [target.new_state()], [10]).logits, hf(ids[None]).logits[0],
                               rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="unknown option"):
        dspark.load_model(hf, prefill_mode="exact")


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_charges_the_kv_cache_it_holds(hf_targets, family):
    """The engine's state budget charges a transformers target exactly the K/V rows its cache holds."""
    from dspark.engine.footprint import request_footprint

    target = hf_targets[family]
    state = target.new_state()
    target(_seq(11, 4), [state], [11])
    held = sum(v.numel() * v.element_size() for k, v in state.snapshot().items() if k.startswith("layers."))
    footprint = request_footprint(target, None)
    assert [k.name for k in footprint.kinds] == ["token_ids", "kv_cache"]
    assert footprint.kinds[1].row_bytes * 11 == held


def test_text_prompts_get_the_tokenizers_bos(make_tiny_hf):
    """A transformers target's text prompts are encoded as `tokenizer(text)` encodes them (BOS
    first), in `generate`, evaluation and the CLI's prompt files; DeepSeek targets keep raw text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from dspark.evaluate import encode_prompt
    from dspark.validate import encode_prompts

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate("the cat sat on a mat".split())}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    target = dspark.load_model(make_tiny_hf("llama"), tokenizer=tokenizer)
    expected = tokenizer("the cat sat")["input_ids"]
    assert expected[0] == 1
    assert encode_prompts(target, "the cat sat")[0] == [expected]
    assert encode_prompt(target, "the cat sat") == expected
    out = dspark.generate(target, "the cat sat", max_new_tokens=4)
    assert out.text is not None and len(out.token_ids) == 4
    tiny = dspark.load_model("random-tiny")
    assert encode_prompts(tiny, "the")[0] == [list(b"the")]


def test_prompt_files_are_encoded_like_prompts(make_tiny_hf, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from dspark.train.cli import read_prompts

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "<bos>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", unk_token="<unk>")
    target = dspark.load_model(make_tiny_hf("llama"), tokenizer=tokenizer)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b"}\n{"text": "b a"}\n')
    assert read_prompts(str(path), target) == [[1, 2, 3], [1, 3, 2]]
