"""Prefill modes (deepseek_v41 spec §6): `bounded_replay` equals `exact` for every call of at most
`sliding_window` rows per request, keeps all global and encoder state exact for longer ones, and
is exactly "encoder on every row, decoder on the last W rows with restarted windows"."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.models.deepseek_v41 import DeepseekV41ForCausalLM

TOL = 1e-5
W, SPLIT, N_LAYERS = 8, 4, 7  # tiny config: window, last KV source (the CED split), layers


def exactly_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if isinstance(a[k], int) else torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def pair(make_model):
    """The same random weights in both modes: (exact, bounded_replay)."""
    return make_model(seed=11, prefill_mode="exact"), make_model(seed=11, prefill_mode="bounded_replay")


def test_split_layer_comes_from_the_config(pair, tiny, make_model):
    exact, bounded = pair
    assert bounded.config.replay_split_layer == SPLIT and bounded.prefill_mode == "bounded_replay"
    moved = make_model(compress_ratios=[0, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[1, 3],
                       index_source_layer_ids=[1, 3, 6], candidate_source_layer_id=3)
    assert moved.config.replay_split_layer == 3
    with pytest.raises(AttributeError):
        bounded.prefill_mode = "exact"  # fixed at construction


def test_equal_to_exact_for_calls_within_the_window(pair, random_ids):
    """Prompts of <= W tokens, then chunks of <= W rows and decode steps: bit-identical."""
    exact, bounded = pair
    ids = random_ids(30, seed=12)
    a, b = exact.new_state(), bounded.new_state()
    for lo, hi in ((0, W), (W, 13), (13, 21), (21, 22), (22, 30)):
        la, lb = exact(ids[lo:hi], [a], [hi - lo]), bounded(ids[lo:hi], [b], [hi - lo])
        assert torch.equal(la.logits, lb.logits) and lb.valid is None
    assert exactly_equal(a.snapshot(), b.snapshot())


def test_long_prompt_keeps_global_and_encoder_state_exact(pair, random_ids):
    exact, bounded = pair
    ids = random_ids(41, seed=13)
    a, b = exact.new_state(), bounded.new_state()
    full = exact(ids, [a], [41], capture_layers=(SPLIT, SPLIT + 1))
    replayed = bounded(ids, [b], [41], capture_layers=(SPLIT, SPLIT + 1))
    sa, sb = a.snapshot(), b.snapshot()
    same = [k for k in sa if k.startswith(("sources", "ngram")) or
            (k.startswith("layers.") and int(k.split(".")[1]) < SPLIT)]
    assert exactly_equal({k: sa[k] for k in same}, {k: sb[k] for k in same})
    for i in range(SPLIT, N_LAYERS):  # decoder windows: only the replayed rows 33..40
        window = b.layers[i].window
        assert (window.start, window.end) == (41 - W, 41)
    assert replayed.valid.tolist() == [False] * (41 - W) + [True] * W
    assert torch.equal(replayed.features[SPLIT], full.features[SPLIT])  # the split layer's input: encoder output
    assert replayed.features[SPLIT + 1][: 41 - W].isnan().all() and replayed.logits[: 41 - W].isnan().all()
    drift = (replayed.logits[-1] - full.logits[-1]).abs().max().item()
    print(f"[deepseek_v41 replay] 41-token prompt, last-row drift vs exact: {drift:.3e}")
    assert 0 < drift < 10 and torch.isfinite(replayed.logits[41 - W:]).all()


def test_bounded_replay_is_encoder_everywhere_decoder_on_the_tail(pair, random_ids):
    """Reference built from exact calls only: the first P − W tokens exactly, then the decoder
    windows restarted at P − W, then the last W tokens exactly (a call of W rows never replays)."""
    exact, bounded = pair
    ids = random_ids(45, seed=14)
    replayed_state = bounded.new_state()
    replayed = bounded(ids, [replayed_state], [45])
    ref_state = exact.new_state()
    exact(ids[: 45 - W], [ref_state], [45 - W])
    ref_state.restart_windows(range(SPLIT, N_LAYERS), 45 - W)
    reference = exact(ids[45 - W:], [ref_state], [W])
    delta = (replayed.logits[45 - W:] - reference.logits).abs().max().item()
    live = ref_state.snapshot(live_only=True), replayed_state.snapshot(live_only=True)
    state_delta = max((x - live[1][k]).abs().max().item() for k, x in live[0].items()
                      if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel())
    print(f"[deepseek_v41 replay] bounded replay vs its exact-call reference: logits {delta:.2e}, "
          f"state {state_delta:.2e}")
    assert delta <= TOL and state_delta <= TOL


def test_replaying_call_is_not_rewindable_but_decodes_on(pair, random_ids, feed):
    _, bounded = pair
    state = bounded.new_state()
    feed(bounded, state, random_ids(20, seed=15))
    assert state.rewind_floor == state.length == 20
    with pytest.raises(ValueError, match="n_keep=19 outside \\[rewind_floor=20"):
        state.truncate(19)
    step = feed(bounded, state, random_ids(3, seed=16))
    assert step.valid is None and torch.isfinite(step.logits).all()
    state.truncate(21)  # a short call is an ordinary, rewindable one


def test_ragged_mode_override_and_batches(pair, random_ids):
    """Per-call override both ways; in a ragged call only requests longer than W replay."""
    exact, bounded = pair
    long, short = random_ids(30, seed=17), random_ids(5, seed=18)
    ref = exact(long, [exact.new_state()], [30]).logits
    assert torch.equal(bounded(long, [bounded.new_state()], [30], prefill_mode="exact").logits, ref)
    replayed = exact(long, [exact.new_state()], [30], prefill_mode="bounded_replay")
    assert replayed.valid.sum() == W
    both = bounded(torch.cat((long, short)), [bounded.new_state(), bounded.new_state()], [30, 5])
    assert both.valid.tolist() == [False] * (30 - W) + [True] * (W + 5)
    assert torch.allclose(both.logits[30 - W: 30], replayed.logits[30 - W:], rtol=0, atol=TOL)
    alone = exact(short, [exact.new_state()], [5]).logits
    assert torch.allclose(both.logits[30:], alone, rtol=0, atol=TOL)


def test_api_options(tiny, tmp_path):
    default = dspark.init_model(tiny(), seed=0)
    assert isinstance(default, DeepseekV41ForCausalLM) and default.prefill_mode == "bounded_replay"
    assert dspark.init_model(tiny(), seed=0, prefill_mode="exact").prefill_mode == "exact"
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v41': unknown option\(s\) \['chunk'\]"):
        dspark.init_model(tiny(), chunk=3)
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v4': unknown option\(s\) \['prefill_mode'\]"):
        dspark.init_model(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()),
                          prefill_mode="exact")
