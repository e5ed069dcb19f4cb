"""Rewindable decode state (docs/design.md): verify-then-truncate, ragged batching, the MTP block.

Truncation is checked two ways. Bit-exactly: after `truncate(n)` the state holds exactly the first
rows of what the verify call stored (windows, compressor rows, entries, indexer keys, tokens).
Against recomputation: it equals the state of feeding only the accepted tokens, and so do the next
logits. The second comparison uses a 1e-5 tolerance because a CPU GEMM does not promise the same
rounding for a row computed in a batch of 9 and in a batch of 3 (MKL picks different kernels for
small M); the measured differences are printed.
"""

import copy

import pytest
import torch

from dspark.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, hf_keys

TOL = 1e-5


def compare_snapshots(a: dict, b: dict) -> float:
    """Same keys, same counters and shapes; returns the max |Δ| over the float tensors."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if isinstance(a[key], int):
            assert a[key] == b[key], (key, a[key], b[key])
            continue
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        if a[key].is_floating_point():
            worst = max(worst, (a[key] - b[key]).abs().max().item() if a[key].numel() else 0.0)
        else:
            assert torch.equal(a[key], b[key]), key
    return worst


def assert_prefix_of(after: dict, before: dict, n_keep: int) -> None:
    """Every tensor of the truncated state is bit-identical to the first rows of the untruncated one."""
    assert after["length"] == n_keep and after["rewind_floor"] == before["rewind_floor"]
    for key, value in after.items():
        if key == "length":
            continue
        if isinstance(value, int):
            assert value == before[key], key
        else:
            assert torch.equal(value, before[key][: value.shape[0]]), key


def test_verify_then_truncate_equals_feeding_accepted_only(model, random_ids):
    """Two requests of different verify lengths in one call; every truncation point 0..k+1.

    Prefixes 21 and 30 put the blocks across CSA (m=4) and HCA (m=8) window boundaries, so
    truncation has to drop emitted entries, indexer keys and half-filled compressor windows.
    """
    prefix_lens, block_lens = (21, 30), (6, 9)
    seqs = [random_ids(p + b + 1, seed=20 + i) for i, (p, b) in enumerate(zip(prefix_lens, block_lens))]
    prefix = [model.new_state() for _ in seqs]
    model(torch.cat([s[:p] for s, p in zip(seqs, prefix_lens)]), prefix, list(prefix_lens))
    blocks = [s[p : p + b] for s, p, b in zip(seqs, prefix_lens, block_lens)]
    worst_state = worst_logits = 0.0
    exact = 0
    for j in range(max(block_lens) + 1):
        keep = [min(j, b) for b in block_lens]
        verified = copy.deepcopy(prefix)
        model(torch.cat(blocks), verified, list(block_lens))
        before = [s.snapshot() for s in verified]
        for state, p, k, snap in zip(verified, prefix_lens, keep, before):
            state.truncate(p + k)
            assert_prefix_of(state.snapshot(), snap, p + k)

        accepted = copy.deepcopy(prefix)
        fed = [(s, blk[:k]) for s, blk, k in zip(accepted, blocks, keep) if k > 0]
        if fed:
            model(torch.cat([ids for _, ids in fed]), [s for s, _ in fed], [len(ids) for _, ids in fed])
        for a, b in zip(verified, accepted):
            live_a, live_b = a.snapshot(live_only=True), b.snapshot(live_only=True)
            worst_state = max(worst_state, compare_snapshots(live_a, live_b))
            exact += all(torch.equal(v, live_b[key]) for key, v in live_a.items() if isinstance(v, torch.Tensor))
            if min(keep) > 0:  # same rewind floor: every stored row must agree, not only the live ones
                worst_state = max(worst_state, compare_snapshots(a.snapshot(), b.snapshot()))

        nxt = torch.stack([s[p + k] for s, p, k in zip(seqs, prefix_lens, keep)])
        la, lb = model(nxt, verified, [1, 1]).logits, model(nxt, accepted, [1, 1]).logits
        worst_logits = max(worst_logits, (la - lb).abs().max().item())
        for a, b in zip(verified, accepted):
            worst_state = max(worst_state, compare_snapshots(a.snapshot(), b.snapshot()))
    print(f"[deepseek_v4 state] truncate vs accepted-only: max|Δ| state {worst_state:.3e}, next logits "
          f"{worst_logits:.3e}; {exact}/{2 * (max(block_lens) + 1)} states bit-identical")
    assert worst_state <= TOL and worst_logits <= TOL


def test_truncate_rejects_out_of_range(model, random_ids, feed):
    state = model.new_state()
    feed(model, state, random_ids(10, seed=1))
    feed(model, state, random_ids(5, seed=2))
    assert (state.rewind_floor, state.length) == (10, 15)
    for bad in (9, 16, -1):
        with pytest.raises(ValueError, match=f"n_keep={bad}.*rewind_floor=10"):
            state.truncate(bad)
    with pytest.raises(ValueError, match="int"):
        state.truncate(12.0)
    state.truncate(10)
    state.truncate(10)  # idempotent at the floor
    assert state.length == 10


def test_truncate_to_floor_after_pruning_still_decodes_like_reference(model, random_ids, feed):
    """Long history (pruned windows) then two verify rounds with full rejection."""
    ids = random_ids(60, seed=5)
    a, b = model.new_state(), model.new_state()
    feed(model, a, ids[:40])
    feed(model, b, ids[:40])
    for _ in range(2):
        feed(model, a, random_ids(7, seed=6))
        a.truncate(40)
    la, lb = feed(model, a, ids[40:60]).logits, feed(model, b, ids[40:60]).logits
    assert (la - lb).abs().max().item() <= TOL
    assert compare_snapshots(a.snapshot(live_only=True), b.snapshot(live_only=True)) <= TOL


def test_ragged_batch_equals_each_request_alone(model, random_ids, feed):
    """Different histories (0, 5, 17 tokens) and different new lengths (7, 1, 4) in one call."""
    histories = [random_ids(n, seed=30 + n) for n in (0, 5, 17)]
    new = [random_ids(n, seed=40 + n) for n in (7, 1, 4)]
    batch_states, alone_states = [], []
    for h in histories:
        s = model.new_state()
        if len(h):
            feed(model, s, h)
        batch_states.append(s)
        alone_states.append(copy.deepcopy(s))
    batched = model(torch.cat(new), batch_states, [len(n) for n in new]).logits
    alone = torch.cat([feed(model, s, n).logits for s, n in zip(alone_states, new)])
    worst = (batched - alone).abs().max().item()
    for a, b in zip(batch_states, alone_states):
        worst = max(worst, compare_snapshots(a.snapshot(), b.snapshot()))
    print(f"[deepseek_v4 state] ragged batch vs alone: max|Δ| = {worst:.3e}")
    assert worst <= TOL


def test_state_survives_switching_between_inference_mode_and_no_grad(model, random_ids, feed):
    ids = random_ids(20, seed=12)
    mixed, plain = model.new_state(), model.new_state()
    with torch.inference_mode():
        feed(model, mixed, ids[:9])
    feed(model, mixed, ids[9:14])  # appends to buffers allocated in inference mode
    mixed.truncate(12)
    feed(model, mixed, ids[12:])
    feed(model, plain, ids[:9])
    feed(model, plain, ids[9:12])
    feed(model, plain, ids[12:])
    assert compare_snapshots(mixed.snapshot(live_only=True), plain.snapshot(live_only=True)) <= TOL


def test_forward_rejects_bad_calls(model, random_ids):
    ids = random_ids(4, seed=0)
    s1, s2 = model.new_state(), model.new_state()
    with pytest.raises(ValueError, match="sum"):
        model(ids, [s1, s2], [1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        model(ids, [s1, s2], [4, 0])
    with pytest.raises(ValueError, match="twice"):
        model(ids, [s1, s1], [2, 2])
    with pytest.raises(ValueError, match="LongTensor"):
        model(ids.int(), [s1], [4])
    with pytest.raises(ValueError, match="capture_layers"):
        model(ids, [s1], [4], capture_layers=(7,))
    assert s1.length == s2.length == 0  # nothing was appended by a rejected call


def test_capture_layers_returns_layer_inputs(model, random_ids):
    ids = random_ids(9, seed=3)
    out = model(ids, [model.new_state()], [9], capture_layers=(0, 3, 6))
    assert sorted(out.features) == [0, 3, 6]
    embedded = model.embed(ids).unsqueeze(1).expand(-1, 4, -1)
    assert torch.equal(out.features[0], embedded)  # layer 0's input: the embedding in every stream
    assert torch.equal(out.features[6], out.hidden)  # input of "layer L": the final streams
    assert out.hidden.shape == (9, 4, 64)


# -------------------------------------------------------------------------------------------------
# MTP block (spec §12)
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_model(tiny):
    return DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(tiny(num_nextn_predict_layers=1))).init_weights(seed=1)


def test_mtp_parameters_are_checkpoint_keys(mtp_model):
    keys = {k for k in mtp_model.state_dict() if k.startswith("mtp.0.")}
    extra = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
             "hc_head_base", "hc_head_scale"}
    assert {f"mtp.0.{k}" for k in extra} <= keys
    layer_like = {k.removeprefix("mtp.0.") for k in keys} - extra
    layer5 = {k.removeprefix("layers.5.") for k in mtp_model.state_dict() if k.startswith("layers.5.")}
    assert layer_like == layer5  # layer 5 is a sliding-window layer, but hash-routed ...
    assert "ffn.gate.bias" in layer_like and "ffn.gate.tid2eid" not in layer_like  # ... the MTP layer is score-routed


def test_mtp_chunked_equals_token_by_token_and_rewinds(mtp_model, random_ids):
    ids = random_ids(30, seed=8)
    main = mtp_model(ids, [mtp_model.new_state()], [30])
    hidden, nxt = main.hidden[:-1], ids[1:]  # row t: streams at t, token t+1
    full = mtp_model.forward_mtp(hidden, nxt, [mtp_model.new_mtp_state()], [29])
    state = mtp_model.new_mtp_state()
    steps = [mtp_model.forward_mtp(hidden[:11], nxt[:11], [state], [11]).logits]
    steps += [mtp_model.forward_mtp(hidden[t : t + 1], nxt[t : t + 1], [state], [1]).logits for t in range(11, 29)]
    assert full.logits.shape == (29, 256) and full.hidden.shape == (29, 4, 64)
    assert (torch.cat(steps) - full.logits).abs().max().item() <= TOL

    rewound = mtp_model.new_mtp_state()
    mtp_model.forward_mtp(hidden[:20], nxt[:20], [rewound], [20])
    mtp_model.forward_mtp(hidden[20:25], random_ids(5, seed=9), [rewound], [5])  # drafts, then rejected
    rewound.truncate(20)
    again = mtp_model.forward_mtp(hidden[20:], nxt[20:], [rewound], [9]).logits
    assert (again - full.logits[20:]).abs().max().item() <= TOL


def test_mtp_block_matches_hf_decoder_layer(mtp_model, tiny, random_ids):
    """The MTP block's layer is a V4 sliding-window, score-routed layer: run HF's layer on the same
    input streams with the MTP weights, and HF's HC head + norm for the collapse."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    hf_config = transformers.DeepseekV4Config(**tiny(num_hidden_layers=1, layer_types=["sliding_attention"],
                                                     mlp_layer_types=["moe"]))
    hf = transformers.DeepseekV4ForCausalLM(hf_config).float().eval()
    mtp_weights = {k.replace("mtp.0.", "layers.0.", 1): v for k, v in mtp_model.state_dict().items()
                   if k.startswith("mtp.0.") and k.removeprefix("mtp.0.").split(".")[0] not in
                   ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn", "hc_head_base", "hc_head_scale")}
    loaded = hf_keys.official_to_hf(mtp_weights)
    missing, unexpected = hf.load_state_dict(loaded, strict=False)
    assert not unexpected and all(not k.startswith("model.layers.0.") for k in missing)

    ids = random_ids(20, seed=11)
    main = mtp_model(ids, [mtp_model.new_state()], [20])
    mtp = mtp_model.mtp[0]
    x = mtp.mix_inputs(mtp_model.embed(ids[1:]), main.hidden[:-1])  # [19, 4, 64]
    ours = mtp_model.forward_mtp(main.hidden[:-1], ids[1:], [mtp_model.new_mtp_state()], [19])

    pos = torch.arange(19)[None]
    window = (pos.T - pos > -1) & (pos.T - pos < tiny()["sliding_window"])  # key j visible to query i
    mask = torch.zeros(1, 1, 19, 19).masked_fill(~window, float("-inf"))
    with torch.no_grad():
        rope = {"main": hf.model.rotary_emb(x, position_ids=pos, layer_type="main")}
        theirs = hf.model.layers[0](x[None], position_embeddings=rope, position_ids=pos, attention_mask=mask,
                                    input_ids=ids[None, 1:], past_key_values=None)[0]
        head = modeling.DeepseekV4HyperHead(hf_config)
        head.load_state_dict({"hc_fn": mtp.hc_head_fn, "hc_base": mtp.hc_head_base, "hc_scale": mtp.hc_head_scale})
        norm = modeling.DeepseekV4RMSNorm(64, eps=1e-6)
        norm.weight.copy_(mtp.norm.weight)
        logits = mtp_model.head(norm(head(theirs[None]))[0])
    delta_streams = (ours.hidden - theirs).abs().max().item()
    delta_logits = (ours.logits - logits).abs().max().item()
    print(f"[deepseek_v4 state] MTP block vs HF layer: streams {delta_streams:.3e}, logits {delta_logits:.3e}")
    assert delta_streams <= 1e-4 and delta_logits <= 1e-4
