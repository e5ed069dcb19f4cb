"""mHC fused across block boundaries (issue 6: "the post site fused with the next pre site").

A block's FFN-site post and the next block's attention-site pre run as one `mhc_post_pre`
(V4) / `mhc_v41_post_pre` (V4.1) op. These tests pin that, on the CPU references:

* the results are bit for bit those of the wiring before the fusion (every block closed:
  pre, post, pre, post, with the models' own torch functions of deepseek_v4/mhc.py), for logits,
  the final streams, captured features and, for V4, the MTP block fed from the final streams;
* the number of mHC op calls per forward, counted by wrapping the registry ops the blocks get:
  V4 2 per layer + 1 (was 3 per layer); V4.1 the same where every boundary may be fused, plus one
  per boundary the spec keeps materialised (the input of an Engram layer, a DSpark capture point,
  the bounded-replay split).

The fused Triton kernels on the whole model (the same wiring) are compared with the references in
test_kernels_model.py (interpreter on CPU).
"""

import json
from collections import Counter
from importlib import resources

import pytest
import torch

from bench.mhc_boundaries import closed_boundaries
from dspark.api import init_model
from dspark.kernels import KernelConfig, get_op, norm_folded_op
from dspark.kernels.registry import NORM_FOLDED
from dspark.models.deepseek_v4 import model as v4_model
from dspark.models.deepseek_v4.mhc import hc_head, hc_post, hc_pre
from dspark.models.deepseek_v4.state import plan_batch
from dspark.models.deepseek_v41 import block as v41_block
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM

REF = KernelConfig.uniform("ref")


def tiny_config(name: str) -> dict:
    return json.loads(resources.files("dspark.configs").joinpath(name).read_text())


def ragged_calls(vocab: int):
    """(ids, seq_lens) of a two-request prefill longer than the window, then one decode step."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, vocab - 2, (19,), generator=g), [13, 6]),
            (torch.randint(0, vocab - 2, (2,), generator=g), [1, 1])]


# ------------------------------------------------------------------------------------------- V4


def closed_v4_block(layer, x, batch, caches):
    """The V4 block as wired before the fusion: pre, attention, post, pre, MoE, post (mhc.py)."""
    iters, hc_eps, norm_eps = layer.sinkhorn_iters, layer.hc_eps, layer.norm_eps
    u, post, comb = hc_pre(x, layer.hc_attn_fn, layer.hc_attn_base, layer.hc_attn_scale, layer.n_hc, iters,
                           hc_eps, norm_eps)
    x = hc_post(layer.attn(layer.attn_norm(u), batch, caches), x, post, comb)
    v, post, comb = hc_pre(x, layer.hc_ffn_fn, layer.hc_ffn_base, layer.hc_ffn_scale, layer.n_hc, iters,
                           hc_eps, norm_eps)
    return hc_post(layer.ffn(layer.ffn_norm(v), batch.input_ids), x, post, comb)


def closed_v4_forward(model, ids, states, seq_lens, capture):
    """`DeepseekV4ForCausalLM.forward` with every block closed: (logits, hidden, features)."""
    batch = plan_batch(ids, states, seq_lens, len(model.layers), model.device)
    x = model.embed(batch.input_ids).unsqueeze(-2).expand(-1, model.config.hc_mult, -1).contiguous()
    features = {}
    for i, layer in enumerate(model.layers):
        if i in capture:
            features[i] = x
        x = closed_v4_block(layer, x, batch, [s.layers[i] for s in states])
    features[len(model.layers)] = x
    h = hc_head(x, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, model.config.hc_eps,
                model.config.rms_norm_eps)
    model._commit(states, batch)
    return model._logits(model.norm(h)), x, features


def closed_v4_mtp(model, hidden, ids, states, seq_lens):
    mtp = model.mtp[0]
    batch = plan_batch(ids, states, seq_lens, 1, model.device)
    x = mtp.mix_inputs(model.embed(batch.input_ids), hidden)
    x = closed_v4_block(mtp, x, batch, [s.layers[0] for s in states])
    model._commit(states, batch)
    return model._logits(mtp.collapse(x))


def test_v4_boundary_fusion_is_bit_identical_on_the_references():
    model = init_model(tiny_config("tiny-v4.json"), seed=1, kernels=REF)
    n_layers = len(model.layers)
    capture = (0, 2, 5, n_layers)
    states, old_states = [model.new_state() for _ in range(2)], [model.new_state() for _ in range(2)]
    mtp_states, old_mtp_states = [model.new_mtp_state() for _ in range(2)], [model.new_mtp_state() for _ in range(2)]
    for ids, lens in ragged_calls(model.config.vocab_size):
        out = model(ids, states, lens, capture_layers=capture)
        logits, hidden, features = closed_v4_forward(model, ids, old_states, lens, capture)
        assert torch.equal(out.logits, logits) and torch.equal(out.hidden, hidden)
        assert out.features.keys() == features.keys()
        assert all(torch.equal(out.features[i], features[i]) for i in capture)
        # The MTP block reads the final streams: materialised by the last block's standalone post.
        draft = model.forward_mtp(out.hidden, ids, mtp_states, lens)
        assert torch.equal(draft.logits, closed_v4_mtp(model, hidden, ids, old_mtp_states, lens))


@pytest.fixture
def count_ops(monkeypatch):
    """Patch `get_op` (and `norm_folded_op`) where the given model module looks them up: every mHC op
    a block fetches counts its calls in the returned Counter, a site with its norm folded in under
    the site op's name (build the model after calling this)."""

    def install(module) -> Counter:
        calls = Counter()

        def counting(op, name):
            def counted(*args, **kwargs):
                calls[name] += 1
                return op(*args, **kwargs)

            return counted

        def counting_get_op(config, name):
            op = get_op(config, name)
            return counting(op, name) if name.startswith("mhc") else op

        monkeypatch.setattr(module, "get_op", counting_get_op)
        if hasattr(module, "norm_folded_op"):
            monkeypatch.setattr(module, "norm_folded_op",
                                lambda config, name: counting(norm_folded_op(config, name), NORM_FOLDED[name]))
        return calls

    return install


def test_v4_counts_two_mhc_ops_per_layer_plus_one(count_ops):
    calls = count_ops(v4_model)
    model = init_model(tiny_config("tiny-v4.json"), seed=1, kernels=REF)
    n_layers = len(model.layers)
    (ids, lens), _ = ragged_calls(model.config.vocab_size)
    out = model(ids, [model.new_state() for _ in lens], lens, capture_layers=(1, 3))
    # One standalone pre (layer 0's attention site), one standalone post (the last FFN site), every
    # other post fused with the pre after it (within blocks and across boundaries).
    assert calls == Counter(mhc_pre=1, mhc_post_pre=2 * n_layers - 1, mhc_post=1)
    assert sum(calls.values()) == 2 * n_layers + 1 < 3 * n_layers
    calls.clear()
    model.forward_mtp(out.hidden, ids, [model.new_mtp_state() for _ in lens], lens)
    assert calls == Counter(mhc_pre=1, mhc_post_pre=1, mhc_post=1)  # a closed block: 3 ops


# ------------------------------------------------------------------------------------------ V4.1


def v41_config(engram_layers: tuple[int, ...] = (1, 4)) -> dict:
    """tiny-v41 (7 layers, KV sources 1 and 4: the replay split is layer 4), with Engram on
    `engram_layers` (a subset of the shipped (1, 4), whose table sizes are kept)."""
    config = tiny_config("tiny-v41.json")
    text = config["text_config"]
    sizes = dict(zip(text["engram_layer_ids"], text["engram_num_embeddings"]))
    text.update(engram_layer_ids=list(engram_layers), engram_num_embeddings=[sizes[i] for i in engram_layers])
    return config


def v41_calls(model, mode: str, capture: tuple[int, ...]):
    """Prefill (13 + 6 tokens, longer than the window: bounded replay skips rows) and one decode
    step; returns every call's output."""
    states = [model.new_state() for _ in range(2)]
    return [model(ids, states, lens, capture_layers=capture, prefill_mode=mode)
            for ids, lens in ragged_calls(model.config.vocab_size)]


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # replay-skipped rows are NaN


@pytest.mark.parametrize("mode", ["exact", "bounded_replay"])
def test_v41_boundary_fusion_is_bit_identical_on_the_references(mode, monkeypatch):
    """Fused boundaries vs every boundary closed (the wiring before the fusion: each block's
    `forward`, whose reference ops are the torch path op for op, test_mhc_v41.py)."""
    model = init_model(v41_config(engram_layers=(1,)), seed=2, kernels=REF)
    capture = (2, 5, len(model.layers))  # read from fused boundaries (2, 5) and the final close; materialised at 1 (and 4: replay)
    fused = v41_calls(model, mode, capture)
    monkeypatch.setattr(DeepseekV41ForCausalLM, "_materialised_inputs",
                        lambda self, replay: frozenset(range(len(self.layers))))
    closed = v41_calls(model, mode, capture)
    for out, want in zip(fused, closed):
        assert_same_bits(out.logits, want.logits)
        assert_same_bits(out.hidden, want.hidden)
        assert out.features.keys() == want.features.keys() == set(capture)
        for i in capture:
            assert_same_bits(out.features[i], want.features[i])
    if mode == "bounded_replay":
        assert fused[0].valid is not None and not fused[0].valid.all()  # the split boundary was live


@pytest.mark.parametrize("engram, mode, capture, materialised", [
    ((1, 4), "exact", (), {1, 4}),                      # Engram layers only
    ((1,), "exact", (), {1}),                           # the split is an ordinary boundary without replay
    ((1,), "bounded_replay", (), {1, 4}),               # the CED split, when this call replays
    ((1,), "exact", (3, 6, 7), {1}),                    # DSpark capture points read the fused boundaries' streams
])
def test_v41_counts_two_mhc_ops_per_layer_plus_one_per_materialised_boundary(count_ops, engram, mode, capture,
                                                                              materialised):
    calls = count_ops(v41_block)
    model = init_model(v41_config(engram), seed=2, kernels=REF)
    n_layers, m = len(model.layers), len(materialised)
    (ids, lens), _ = ragged_calls(model.config.vocab_size)
    model(ids, [model.new_state() for _ in lens], lens, capture_layers=capture, prefill_mode=mode)
    # A materialised boundary is a standalone post then a standalone pre (the wiring before: every
    # boundary); any other is one post+pre.
    assert calls == Counter(mhc_v41_pre=1 + m, mhc_v41_post_pre=n_layers + (n_layers - 1 - m), mhc_post=1 + m)
    assert sum(calls.values()) == 2 * n_layers + 1 + m


@pytest.mark.parametrize("family, config", [("v4-mini", "tiny-v4.json"), ("v41-mini", "tiny-v41.json")])
def test_bench_closed_wiring_is_three_ops_per_layer_and_the_same_bits(count_ops, family, config):
    """bench/mhc_boundaries.py times the fused boundaries against this patched-in wiring: every
    boundary a standalone post and pre, 3 mHC ops per layer, the same results on the references."""
    calls = count_ops(v4_model if family == "v4-mini" else v41_block)
    model = init_model(tiny_config(config), seed=1, kernels=REF, **({} if family == "v4-mini" else
                                                                   dict(prefill_mode="exact")))
    (ids, lens), _ = ragged_calls(model.config.vocab_size)
    fused = model(ids, [model.new_state() for _ in lens], lens)
    fused_calls = sum(calls.values())
    calls.clear()
    with closed_boundaries(family):
        closed = model(ids, [model.new_state() for _ in lens], lens)
    n_layers = len(model.layers)
    assert sum(calls.values()) == 3 * n_layers and fused_calls < 3 * n_layers
    assert torch.equal(fused.logits, closed.logits) and torch.equal(fused.hidden, closed.hidden)
