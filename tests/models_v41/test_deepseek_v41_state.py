"""Rewindable decode state of DeepSeek-V4.1 (docs/design.md): verify a block, truncate to the
accepted prefix, and the state equals feeding only the accepted tokens — per-layer windows, the
KV sources' compressor rows, entries and index keys, and the Engram n-gram history.

Truncation is checked two ways, as for V4 (tests/models/test_deepseek_v4_state.py): bit-exactly,
the truncated state holds the first rows of what the verify call stored; against recomputation,
within 1e-5 fp32 (a row computed in a batch of 9 or of 3 may round differently). The
recomputation comparisons run without the cache QAT (see conftest.py); with it, the stored values
are checked to lie on their FP8 / FP4 grids and the prefix property is checked bit-exactly.
"""

import copy

import pytest
import torch

import dspark
from dspark.models.deepseek_v41.qat import fp4_e4m3, fp4_ue8m0, fp8_ue8m0

TOL = 1e-5


def compare_snapshots(a: dict, b: dict) -> float:
    """Same keys, counters, shapes and integer tensors; returns the max |Δ| over float tensors."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if isinstance(a[key], int):
            assert a[key] == b[key], (key, a[key], b[key])
            continue
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        if not a[key].is_floating_point():
            assert torch.equal(a[key], b[key]), key
        elif a[key].numel():
            worst = max(worst, (a[key] - b[key]).abs().max().item())
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


def verify_rounds(model, random_ids, check_recomputed: bool):
    """Two requests with prefixes 21 and 30 (odd and even: mid ratio-2 group or not) verify blocks
    of 6 and 9 in one call, truncated at every accepted length. Returns the worst deltas."""
    prefix_lens, block_lens = (21, 30), (6, 9)
    seqs = [random_ids(p + b + 1, seed=20 + i) for i, (p, b) in enumerate(zip(prefix_lens, block_lens))]
    prefix = [model.new_state() for _ in seqs]
    model(torch.cat([s[:p] for s, p in zip(seqs, prefix_lens)]), prefix, list(prefix_lens))
    blocks = [s[p : p + b] for s, p, b in zip(seqs, prefix_lens, block_lens)]
    worst_state = worst_logits = 0.0
    for j in range(max(block_lens) + 1):
        keep = [min(j, b) for b in block_lens]
        verified = copy.deepcopy(prefix)
        model(torch.cat(blocks), verified, list(block_lens))
        before = [s.snapshot() for s in verified]
        for state, p, k, snap in zip(verified, prefix_lens, keep, before):
            state.truncate(p + k)
            assert_prefix_of(state.snapshot(), snap, p + k)
        if not check_recomputed:
            continue
        accepted = copy.deepcopy(prefix)
        fed = [(s, blk[:k]) for s, blk, k in zip(accepted, blocks, keep) if k > 0]
        if fed:
            model(torch.cat([ids for _, ids in fed]), [s for s, _ in fed], [len(ids) for _, ids in fed])
        for a, b in zip(verified, accepted):
            worst_state = max(worst_state, compare_snapshots(a.snapshot(live_only=True), b.snapshot(live_only=True)))
            if min(keep) > 0:  # same rewind floor: every stored row must agree, not only the live ones
                worst_state = max(worst_state, compare_snapshots(a.snapshot(), b.snapshot()))
        nxt = torch.stack([s[p + k] for s, p, k in zip(seqs, prefix_lens, keep)])
        la, lb = model(nxt, verified, [1, 1]).logits, model(nxt, accepted, [1, 1]).logits
        worst_logits = max(worst_logits, (la - lb).abs().max().item())
        for a, b in zip(verified, accepted):
            worst_state = max(worst_state, compare_snapshots(a.snapshot(), b.snapshot()))
    return worst_state, worst_logits


def test_verify_then_truncate_equals_feeding_accepted_only(model, random_ids):
    worst_state, worst_logits = verify_rounds(model, random_ids, check_recomputed=True)
    print(f"[deepseek_v41 state] truncate vs accepted-only: max|Δ| state {worst_state:.2e}, "
          f"next logits {worst_logits:.2e}")
    assert worst_state <= TOL and worst_logits <= TOL


def test_state_parts_cover_sources_and_ngram_history(model, random_ids, feed):
    state = model.new_state()
    feed(model, state, random_ids(11, seed=1))
    feed(model, state, random_ids(3, seed=2))
    snap = state.snapshot()
    assert {k.rsplit(".", 1)[0] for k in snap if k.startswith(("sources", "ngram"))} == {"sources.1", "sources.4",
                                                                                        "ngram"}
    assert snap["sources.1.entries"].shape == (7, 32) and snap["sources.1.index_keys"].shape == (7, 32)
    assert snap["sources.4.entries"].shape == (14, 32) and snap["sources.4.kv_rows"].shape == (0, 32)
    # Floor 11: ratio-2 rows from 10 on (group 5 was incomplete then); ngram ids of 8, 9, 10 and new.
    assert (snap["sources.1.rows_start"], snap["sources.1.kv_rows"].shape[0]) == (10, 4)
    assert snap["ngram.start"] == 8 and snap["ngram.ids"].shape == (6,)
    live = state.snapshot(live_only=True)
    assert (live["sources.1.rows_start"], live["ngram.start"], live["ngram.ids"].shape) == (14, 11, (3,))


def test_truncate_rejects_out_of_range(model, random_ids, feed):
    state = model.new_state()
    feed(model, state, random_ids(10, seed=1))
    feed(model, state, random_ids(5, seed=2))
    assert (state.rewind_floor, state.length) == (10, 15)
    for bad in (9, 16, -1):
        with pytest.raises(ValueError, match=f"n_keep={bad}.*rewind_floor=10"):
            state.truncate(bad)
    before = state.snapshot()
    with pytest.raises(ValueError, match="int"):
        state.truncate(12.0)
    assert compare_snapshots(state.snapshot(), before) == 0.0  # a rejected truncate changes nothing
    state.truncate(11)
    state.truncate(11)  # idempotent
    assert state.length == 11 and state.sources[1].n_entries == 5 and state.ngram.end == 11


def test_rejected_drafts_after_pruning_decode_like_reference(model, random_ids, feed):
    """Long history (pruned windows, rows and n-gram ids), then two verify rounds rejected in full."""
    ids = random_ids(60, seed=5)
    a, b = model.new_state(), model.new_state()
    feed(model, a, ids[:41])
    feed(model, b, ids[:41])
    for seed in (6, 7):
        feed(model, a, random_ids(7, seed=seed))
        a.truncate(41)
    la, lb = feed(model, a, ids[41:60]).logits, feed(model, b, ids[41:60]).logits
    assert (la - lb).abs().max().item() <= TOL
    assert compare_snapshots(a.snapshot(live_only=True), b.snapshot(live_only=True)) <= TOL


def test_forward_rejects_bad_calls(model, random_ids):
    ids = random_ids(4, seed=0)
    s1, s2 = model.new_state(), model.new_state()
    with pytest.raises(ValueError, match="sum"):
        model(ids, [s1, s2], [1, 2])
    with pytest.raises(ValueError, match="twice"):
        model(ids, [s1, s1], [2, 2])
    with pytest.raises(ValueError, match="LongTensor"):
        model(ids.int(), [s1], [4])
    assert s1.length == s2.length == 0  # nothing was appended by a rejected call


def test_quantised_state_is_on_its_grids_and_truncates_bit_exactly(make_model, random_ids, feed):
    """With the cache QAT (the trained model's numerics): every stored window latent, entry and
    index key is a fixed point of its quantiser, and truncation keeps exact prefixes."""
    model = make_model(seed=3, cache_qat=True)
    plain = make_model(seed=3)
    ids = random_ids(30, seed=4)
    assert (feed(model, model.new_state(), ids).logits - feed(plain, plain.new_state(), ids).logits).abs().max() > 1e-3
    verify_rounds(model, random_ids, check_recomputed=False)
    state = model.new_state()
    feed(model, state, ids)
    for i in range(7):
        window = state.layers[i].window.latents()
        assert torch.equal(fp8_ue8m0(window), window), i
    for source in state.sources.values():
        assert torch.equal(fp4_e4m3(source.entries()), source.entries())
        assert torch.equal(fp4_ue8m0(source.index_keys()), source.index_keys())


def test_speculative_generate_equals_plain_greedy(make_model):
    """The whole loop (dspark.generate): n-gram drafts verified in ragged calls and truncated to the
    accepted prefix give the plain greedy continuation; the 40-token prompt is prefilled with the
    model's default bounded replay (a verify block of <= 5 rows never replays)."""
    model = make_model(seed=9, prefill_mode="bounded_replay")
    prompt = [int(t) for t in torch.arange(40) % 7 + 60]  # repetitive: prompt lookup finds drafts
    plain = dspark.generate(model, prompt, max_new_tokens=24)
    spec = dspark.generate(model, prompt, max_new_tokens=24, draft_tokens=4, drafter="ngram")
    assert spec.token_ids == plain.token_ids and spec.stats.rounds < 24
