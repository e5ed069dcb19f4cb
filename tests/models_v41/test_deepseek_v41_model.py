"""The DeepSeek-V4.1 model: checkpoint-key layout of the release, one-shot = chunked = token by
token, ragged batches, captured features, Engram and image-token semantics, options."""

import collections
import copy

import pytest
import torch

from dspark.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from dspark.models.deepseek_v41.checkpoint import disk_format
from dspark.models.deepseek_v41.engram_hash import build_token_map

TOL = 1e-5


def test_released_model_has_the_released_keys(released_config):
    """Built on the meta device from the released config: per-layer on-disk tensor counts equal the
    header census of the real checkpoint (spec §2.3: plain 2 334, Engram 2 340, Full ratio 2
    2 342, layer 14 2 348, layer 20 2 341, Reindex 2 337; 3 globals; 96 085 with the 2 401 DSpark
    and 266 vision tensors this module does not own) and parameters total 748.5 B (§2.5:
    551.6 B backbone + 196.9 B Engram)."""
    config = DeepseekV41Config.from_dict(released_config())
    model = DeepseekV41ForCausalLM(config, device="meta", engram_tables="device")
    per_layer = collections.Counter()
    for key in model.state_dict():
        n_disk = 2 if disk_format(key) in ("fp8", "fp8_rows", "fp4") else 1  # weight + block scale
        per_layer[int(key.split(".")[1]) if key.startswith("layers.") else "global"] += n_disk
    expected = {i: 2334 for i in range(40)}
    expected.update({1: 2340, 2: 2342, 8: 2342, 14: 2348, 20: 2341, 24: 2337, 28: 2337, 32: 2337, 36: 2337})
    assert {i: per_layer[i] for i in range(40)} == expected and per_layer["global"] == 3
    assert sum(per_layer.values()) + 2401 + 266 == 96085
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 748.5


def test_parameter_names_per_role(model):
    keys = set(model.state_dict())
    layer = {i: {k.split(".", 2)[2] for k in keys if k.startswith(f"layers.{i}.")} for i in range(7)}
    assert {"embed.weight", "norm.weight", "head.weight"} <= keys and not any("hc_head" in k for k in keys)
    full2 = {"attn.compressor.wkv.weight", "attn.compressor.wgate.weight", "attn.compressor.norm.weight",
             "attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight", "attn.indexer.wk.weight",
             "attn.indexer.k_norm.weight"}
    engram = {"engram.embed.weight", "engram.wkv.weight", "engram.q_weight", "engram.k_weight"}
    assert layer[1] - layer[0] == full2 | engram and layer[0] == layer[2] == layer[3] == layer[5]
    assert layer[4] - layer[0] == (full2 - {"attn.compressor.wgate.weight"}) | engram
    assert layer[6] - layer[0] == {"attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"}
    assert {"ffn.gate.bias", "ffn.gate.bias_vl", "attn.attn_sink", "hc_attn_fn"} <= layer[0]
    assert not any("ape" in k or "tid2eid" in k or "q_b_norm" in k for k in keys)
    assert model.state_dict()["layers.4.engram.embed.weight"].shape == (630, 32)
    assert model.state_dict()["layers.1.engram.wkv.weight"].shape == (5 * 64, 6 * 32)


def test_one_shot_equals_chunked_equals_token_by_token(model, random_ids, feed):
    """Splits inside a ratio-2 group (13), across window, candidate-block and top-k boundaries."""
    ids = random_ids(60, seed=1)
    full = feed(model, model.new_state(), ids)
    state = model.new_state()
    chunked = torch.cat([feed(model, state, ids[a:b]).logits for a, b in ((0, 13), (13, 30), (30, 31), (31, 60))])
    state = model.new_state()
    steps = [feed(model, state, ids[:7]).logits] + [feed(model, state, ids[t:t + 1]).logits for t in range(7, 60)]
    delta_chunked = (chunked - full.logits).abs().max().item()
    delta_steps = (torch.cat(steps) - full.logits).abs().max().item()
    print(f"[deepseek_v41] one-shot vs chunked {delta_chunked:.2e}, vs token-by-token {delta_steps:.2e}")
    assert full.logits.shape == (60, 258) and full.valid is None
    assert delta_chunked <= TOL and delta_steps <= TOL
    # The last call started at 59: pruning kept the ratio-2 rows from 58 on (the group then still
    # incomplete) and the W − 1 = 7 latents before 59; the call appended row / latent 59.
    sources = state.sources
    assert (sources[1].n_entries, sources[4].n_entries, sources[1].rows_start, sources[1].rows_end) == (30, 60, 58, 60)
    assert (state.layers[0].window.start, state.layers[0].window.end) == (52, 60)


def test_ragged_batch_equals_each_request_alone(model, random_ids, feed):
    """Histories 0, 5 and 17 tokens; new lengths 7, 1 and 4 in one call."""
    histories = [random_ids(n, seed=30 + n) for n in (0, 5, 17)]
    new = [random_ids(n, seed=40 + n) for n in (7, 1, 4)]
    batch_states = []
    for h in histories:
        s = model.new_state()
        if len(h):
            feed(model, s, h)
        batch_states.append(s)
    alone_states = copy.deepcopy(batch_states)
    batched = model(torch.cat(new), batch_states, [len(n) for n in new]).logits
    alone = torch.cat([feed(model, s, n).logits for s, n in zip(alone_states, new)])
    worst = (batched - alone).abs().max().item()
    for a, b in zip(batch_states, alone_states):
        sa, sb = a.snapshot(), b.snapshot()
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], int) or not sa[key].is_floating_point():
                assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key
            elif sa[key].numel():
                worst = max(worst, (sa[key] - sb[key]).abs().max().item())
    print(f"[deepseek_v41] ragged batch vs alone: max|Δ| = {worst:.2e}")
    assert worst <= TOL


def test_capture_layers_are_layer_inputs_after_engram(model, random_ids):
    ids = random_ids(9, seed=3)
    seen, layer = {}, model.layers[1]
    opened = layer.open  # the model runs a layer by opening it on its input streams
    layer.open = lambda x, *args: (seen.update(x1=x), opened(x, *args))[1]
    try:
        out = model(ids, [model.new_state()], [9], capture_layers=(0, 1, 7))
    finally:
        del layer.open
    assert sorted(out.features) == [0, 1, 7] and out.hidden.shape == (9, 4, 64)
    assert torch.equal(out.features[0], model.embed(ids).unsqueeze(1).expand(-1, 4, -1))
    assert torch.equal(out.features[1], seen["x1"])  # what layer 1's block received: after Engram
    assert not torch.equal(out.features[1][:, 0], out.features[1][:, 1])  # Engram gates differ per stream
    assert torch.equal(out.features[7], out.hidden)
    with pytest.raises(ValueError, match=r"capture_layers \[8\] outside \[0, 7\]"):
        model(ids, [model.new_state()], [9], capture_layers=(8,))


def test_engram_and_image_tokens(make_model, random_ids, feed):
    """Engram moves the logits; an image token shuts its gate, blocks n-grams through it and
    routes with `bias_vl`."""
    ids = random_ids(20, seed=4, vocab=255)  # 255 is the image token below
    plain = make_model(seed=5)
    no_engram = make_model(seed=5)
    for i in (1, 4):
        no_engram.layers[i].engram.wkv.weight.zero_()  # value and keys 0: the added value is 0
    assert (feed(plain, plain.new_state(), ids).logits - feed(no_engram, no_engram.new_state(), ids).logits
            ).abs().max() > 1e-2

    vision = make_model(seed=5, image_token_id=255)
    ids[5] = 255
    base = feed(plain, plain.new_state(), ids).logits
    with_image = feed(vision, vision.new_state(), ids).logits
    # Rows before the image token agree up to fp32 noise (its different experts change the batching).
    assert torch.allclose(base[:5], with_image[:5], rtol=0, atol=TOL)
    assert ((base[5:] - with_image[5:]).abs().amax(-1) > 0.1).all()
    # bias_vl is what image tokens route with: forcing experts 6 and 7 everywhere changes rows >= 5 only.
    for layer in vision.layers:
        layer.ffn.gate.bias_vl.copy_(torch.linspace(-50, 50, 8))
    rerouted = feed(vision, vision.new_state(), ids).logits
    assert torch.allclose(rerouted[:5], with_image[:5], rtol=0, atol=TOL)
    assert (rerouted[5:] - with_image[5:]).abs().max() > 0.1


def test_bound_tokenizer_drives_the_hashes(make_model, random_ids, feed, bpe_tokenizer):
    tokenizer = bpe_tokenizer()
    token_map, n_compressed = build_token_map(tokenizer)
    with pytest.raises(ValueError, match=f"engram_compressed_vocab_size: 258 but the tokenizer gives {n_compressed}"):
        make_model(seed=6).bind_tokenizer(tokenizer)
    model = make_model(seed=6, engram_compressed_vocab_size=n_compressed)
    ids = random_ids(12, seed=7, vocab=len(token_map))
    identity = feed(model, model.new_state(), ids).logits
    model.bind_tokenizer(tokenizer)
    assert model.engram_token_map[: len(token_map)].tolist() == token_map
    assert (model.engram_token_map[len(token_map):] == token_map[2]).all()  # padding ids -> the pad's id
    assert not torch.allclose(feed(model, model.new_state(), ids).logits, identity)


def test_options_are_validated_and_host_tables_agree(make_model, tiny, random_ids, feed):
    config = DeepseekV41Config.from_dict(tiny())
    with pytest.raises(ValueError, match="prefill_mode: 'fast' is not one of"):
        DeepseekV41ForCausalLM(config, prefill_mode="fast")
    with pytest.raises(ValueError, match="engram_tables: 'disk' is not one of"):
        DeepseekV41ForCausalLM(config, engram_tables="disk")
    device = make_model(seed=8)
    host = DeepseekV41ForCausalLM(config, prefill_mode="exact", engram_tables="host", cache_qat=False).init_weights(8)
    assert host.layers[1].engram.embed.host and not device.layers[1].engram.embed.host
    ids = random_ids(15, seed=9)
    assert torch.equal(feed(host, host.new_state(), ids).logits, feed(device, device.new_state(), ids).logits)
    with pytest.raises(ValueError, match="prefill_mode: 'fast'"):
        feed(device, device.new_state(), ids, prefill_mode="fast")


def test_bfloat16_model_runs(tiny, random_ids, feed):
    """The defaults (bounded replay, cache QAT) in bf16: a 20-token prompt replays its last 8 rows."""
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(tiny()), dtype=torch.bfloat16).init_weights(0)
    assert model.head.weight.dtype == torch.bfloat16 and model.layers[0].hc_attn_fn.dtype == torch.float32
    out = feed(model, model.new_state(), random_ids(20, seed=10))
    assert out.logits.dtype == torch.float32 and out.valid.tolist() == [False] * 12 + [True] * 8
    assert torch.isfinite(out.logits[out.valid]).all() and out.logits[~out.valid].isnan().all()
