"""DeepSeek-V4 against HF transformers 5.23 in fp32 on the tiny config (spec §18.1, §18.3).

Same weights (HF's state dict through `hf_keys`), compared on: logits of a full forward, of chunked
prefill and of token-by-token decode; greedy continuations; every layer's compressed entries,
indexer keys and window; the indexer's top-k sets. Run with `-s` to see the measured max |Δ|.
"""

import pytest
import torch

TINY_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
WINDOW, VOCAB = 8, 256
TOL = 1e-4  # fp32; measured errors are ~1e-6 (printed)


def report(name: str, delta: float) -> float:
    print(f"[deepseek_v4 parity] {name}: max|Δ| = {delta:.3e}")
    return delta


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


@pytest.mark.parametrize("length", [41, 70])
def test_full_forward_matches_hf(model, hf_model, random_ids, feed, length):
    ids = random_ids(length, seed=length)
    ours = feed(model, model.new_state(), ids).logits
    delta = report(f"full forward, {length} tokens", (ours - hf_logits(hf_model, ids)).abs().max().item())
    assert ours.dtype == torch.float32 and ours.shape == (length, VOCAB)
    assert delta <= TOL, delta


@pytest.mark.parametrize("splits", [(13, 17, 11), (1, 40), (4, 4, 33), (7, 1, 1, 32), (3, 5, 8, 9, 16)])
def test_chunked_prefill_matches_hf_full_forward(model, hf_model, random_ids, feed, splits):
    ids = random_ids(sum(splits), seed=1)
    state, start, logits = model.new_state(), 0, []
    for n in splits:
        logits.append(feed(model, state, ids[start : start + n]).logits)
        start += n
    delta = report(f"chunked prefill {splits}", (torch.cat(logits) - hf_logits(hf_model, ids)).abs().max().item())
    assert state.length == len(ids)
    assert delta <= TOL, delta


@pytest.mark.parametrize("prefill", [1, 5, 17])
def test_prefill_then_token_by_token_decode_matches_hf(model, hf_model, random_ids, feed, prefill):
    ids = random_ids(41, seed=2)
    state = model.new_state()
    logits = [feed(model, state, ids[:prefill]).logits]
    logits += [feed(model, state, ids[i : i + 1]).logits for i in range(prefill, len(ids))]
    delta = (torch.cat(logits) - hf_logits(hf_model, ids)).abs().max().item()
    report(f"prefill {prefill} + decode to 41", delta)
    assert delta <= TOL, delta


def greedy(model, prompts: list[torch.Tensor], n_new: int) -> list[list[int]]:
    """Greedy decoding of all prompts in one ragged call per step (prefill, then 1 token each)."""
    states = [model.new_state() for _ in prompts]
    logits = model(torch.cat(prompts), states, [len(p) for p in prompts]).logits
    last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    tokens = logits[last_rows].argmax(-1)
    out = [[t] for t in tokens.tolist()]
    for _ in range(n_new - 1):
        tokens = model(tokens, states, [1] * len(prompts)).logits.argmax(-1)
        for seq, t in zip(out, tokens.tolist()):
            seq.append(t)
    return out


def test_greedy_decode_matches_hf_generate(model, hf_model, random_ids):
    g = torch.Generator().manual_seed(7)
    prompts = [random_ids(int(torch.randint(3, 30, (1,), generator=g)), seed=100 + i) for i in range(8)]
    ours = greedy(model, prompts, 48)
    with torch.no_grad():
        theirs = [hf_model.generate(p[None], max_new_tokens=48, do_sample=False)[0, len(p):].tolist() for p in prompts]
    mismatched = [i for i in range(len(prompts)) if ours[i] != theirs[i]]
    print(f"[deepseek_v4 parity] greedy 8 prompts x 48 tokens: {8 - len(mismatched)}/8 identical")
    assert not mismatched, [(ours[i], theirs[i]) for i in mismatched]


def _hf_cache_after(hf_model, ids: torch.Tensor, splits: tuple[int, ...]):
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache(config=hf_model.config)
    start = 0
    with torch.no_grad():
        for n in splits:
            hf_model(ids[None, start : start + n], past_key_values=cache, use_cache=True)
            start += n
    return cache


@pytest.mark.parametrize("splits", [(41,), (13, 17, 11), (5,) + (1,) * 36])
def test_compressed_entries_and_windows_match_hf_cache(model, hf_model, random_ids, feed, splits):
    ids = random_ids(sum(splits), seed=3)
    state, start = model.new_state(), 0
    for n in splits:
        feed(model, state, ids[start : start + n])
        start += n
    cache = _hf_cache_after(hf_model, ids, splits)
    worst = 0.0
    for i, layer_type in enumerate(TINY_LAYER_TYPES):
        ours, theirs = state.layers[i], cache.layers[i]
        window = ours.window.latents()[-(WINDOW - 1) :]
        assert window.shape == theirs.keys[0, 0].shape
        worst = max(worst, (window - theirs.keys[0, 0]).abs().max().item())
        parts = {CSA: ("compressor", "indexer"), HCA: ("compressor",)}.get(layer_type, ())
        for part in parts:
            entries = getattr(ours, part).entries()
            assert entries.shape == theirs.compressed_kv[part][0].shape, (i, part)
            assert getattr(ours, part).n_entries == theirs.entry_count[part]
            worst = max(worst, (entries - theirs.compressed_kv[part][0]).abs().max().item())
    report(f"windows / compressed entries / indexer keys, splits {splits[:3]}...", worst)
    assert worst <= TOL


def _capture_outputs(modules):
    """Record every output of each module (forward hooks); returns (records, handles)."""
    records = {i: [] for i in modules}
    handles = [m.register_forward_hook(lambda _m, _a, out, i=i: records[i].append(out.detach().clone()))
               for i, m in modules.items()]
    return records, handles


def _pick_sets(picks: torch.Tensor) -> list[list[int]]:
    return [sorted(t for t in row.tolist() if t >= 0) for row in picks]


@pytest.mark.parametrize("decode_from", [None, 20])
def test_indexer_topk_sets_match_hf(model, hf_model, random_ids, feed, decode_from):
    """Per query position, the set of entries the indexer keeps (prefill and one-token decode)."""
    ids = random_ids(64, seed=4)
    csa = [i for i, t in enumerate(TINY_LAYER_TYPES) if t == CSA]
    ours_rec, h1 = _capture_outputs({i: model.layers[i].attn.indexer for i in csa})
    hf_rec, h2 = _capture_outputs({i: hf_model.model.layers[i].self_attn.compressor.indexer for i in csa})
    try:
        splits = (64,) if decode_from is None else (decode_from,) + (1,) * (64 - decode_from)
        state, start = model.new_state(), 0
        for n in splits:
            feed(model, state, ids[start : start + n])
            start += n
        _hf_cache_after(hf_model, ids, splits)
    finally:
        for h in h1 + h2:
            h.remove()
    compared = 0
    for i in csa:
        ours = [s for out in ours_rec[i] for s in _pick_sets(out)]
        theirs = [s for out in hf_rec[i] for s in _pick_sets(out[0])]
        assert len(ours) == len(theirs) == 64
        assert ours == theirs, f"layer {i}: first difference at {next(p for p in range(64) if ours[p] != theirs[p])}"
        compared += sum(len(s) for s in ours)
    print(f"[deepseek_v4 parity] indexer top-k sets ({'prefill' if decode_from is None else 'decode'}): "
          f"{compared} picks over {len(csa)} layers x 64 positions identical")
    assert compared > 0
