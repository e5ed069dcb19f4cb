"""Batched attention (one `sparse_attention` call per layer for all requests of a ragged call)
against the per-request path it replaced (`Attention.forward_per_request`), on CPU in fp32.

The tiny config has SWA, CSA (rate 4, top-3) and HCA (rate 8) layers and window 8. Requests with
different histories (0 .. 30 tokens) are fed decode steps, verify blocks and a mixed
prefill + decode call, so positions cross the window, the CSA and the HCA boundaries at different
steps per request; the indexer runs both its padded multi-request pass (decode, verify) and its
per-request fallback (the mixed call). Logits and every stored state tensor must agree.
"""

import copy

import pytest
import torch

from dspark.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dspark.models.deepseek_v4.state import plan_batch

# Relative to each tensor's largest magnitude. One-request calls come out bit-identical; in a
# batch, key lists are padded with −1 columns to the longest request's (HCA: all entries; CSA: the
# top-k while a request has fewer entries), which changes the CPU GEMM's reduction blocking.
TOL = 2e-6  # measured: <= 8.2e-7 (a few fp32 ulps, accumulated over the 6 layers)
HISTORIES = (0, 3, 9, 17, 30)


def per_request_model(model: DeepseekV4ForCausalLM) -> DeepseekV4ForCausalLM:
    """A copy whose attention layers run the old per-request loop."""
    old = copy.deepcopy(model)
    for layer in old.layers:
        layer.attn.forward = layer.attn.forward_per_request
    return old


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (0 for empty tensors)."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) if b.numel() else 0.0


def max_state_diff(a, b) -> float:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.keys() == sb.keys()
    worst = 0.0
    for key, value in sa.items():
        if isinstance(value, int) or not value.is_floating_point():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[key])), key
        else:
            assert value.shape == sb[key].shape, key
            worst = max(worst, rel_diff(value, sb[key]))
    return worst


@pytest.fixture(scope="module")
def pair(tiny):
    new = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(tiny())).init_weights(seed=3).eval()
    return new, per_request_model(new)


def run_both(pair, states_new, states_old, seq_lens, seed):
    new, old = pair
    ids = torch.randint(0, 256, (sum(seq_lens),), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a = new(ids, states_new, list(seq_lens)).logits
        b = old(ids, states_old, list(seq_lens)).logits
    worst = rel_diff(a, b)
    for x, y in zip(states_new, states_old):
        worst = max(worst, max_state_diff(x, y))
    return worst


def test_batched_attention_equals_per_request_path(pair):
    new, _ = pair
    states_new = [new.new_state() for _ in HISTORIES]
    states_old = [new.new_state() for _ in HISTORIES]
    worst = 0.0
    # Histories: request b gets HISTORIES[b] tokens in one call (request 0 starts empty later).
    fed = [(b, n) for b, n in enumerate(HISTORIES) if n]
    worst = max(worst, run_both(pair, [states_new[b] for b, _ in fed], [states_old[b] for b, _ in fed],
                                [n for _, n in fed], seed=0))
    calls = [[1] * 5] * 9 + [[3] * 5] * 3 + [[7, 1, 4, 1, 1]] + [[1] * 5] * 6  # decode, verify, mixed, decode
    for step, seq_lens in enumerate(calls):
        worst = max(worst, run_both(pair, states_new, states_old, seq_lens, seed=1 + step))
    print(f"[batched attention] max relative |Δ| of logits and state over {len(calls) + 1} calls: {worst:.3e}")
    assert worst <= TOL
    lengths = [s.length for s in states_new]
    assert lengths == [h + 9 + 9 + s + 6 for h, s in zip(HISTORIES, (7, 1, 4, 1, 1))]


def test_one_attention_call_per_layer(pair, monkeypatch):
    new, _ = pair
    model = copy.deepcopy(new)
    calls = []
    for layer in model.layers:
        op = layer.attn.attend_op
        layer.attn.attend_op = lambda *args, op=op: calls.append(args[0].shape[0]) or op(*args)
    states = [model.new_state() for _ in range(4)]
    with torch.no_grad():
        model(torch.arange(4 * 9) % 256, states, [9] * 4)
        model(torch.arange(4), states, [1] * 4)
    assert calls == [36] * len(model.layers) + [4] * len(model.layers)


def test_indexer_padded_pass_equals_per_request_calls(pair):
    """The padded multi-request scoring picks exactly what the registry op picks per request."""
    new, _ = pair
    indexer = next(layer.attn.indexer for layer in new.layers if layer.attn.indexer is not None)
    g = torch.Generator().manual_seed(7)
    seq_lens, lengths = [2, 2, 1, 2], [40, 9, 23, 2]  # request lengths before the call: T_b = 10, 2, 6, 1
    states = [new.new_state() for _ in seq_lens]
    for state, n in zip(states, lengths):
        state._tokens.append(torch.zeros(n, dtype=torch.long))  # positions only: the indexer reads lengths
    batch = plan_batch(torch.zeros(sum(seq_lens), dtype=torch.long), states, seq_lens, len(new.layers), "cpu")
    n = sum(seq_lens)
    q = torch.randn(n, indexer.n_heads, indexer.head_dim, generator=g)
    weights = torch.randn(n, indexer.n_heads, generator=g)
    keys = [torch.randn((length + s) // indexer.rate, indexer.head_dim, generator=g)
            for length, s in zip(lengths, seq_lens)]
    picks = indexer.select(q, weights, keys, batch)
    assert picks.shape == (n, indexer.topk)
    for b, request_keys in enumerate(keys):
        rows = batch.rows(b)
        alone = indexer(q[rows], weights[rows], request_keys, batch.positions[rows])
        expected = torch.full((alone.shape[0], indexer.topk), -1, dtype=torch.long)
        expected[:, : alone.shape[1]] = alone
        assert torch.equal(picks[rows], expected), b


@pytest.mark.parametrize("kind", ["compressor", "indexer"])
def test_compressor_update_batch_equals_per_request_updates(pair, kind):
    """Entries pooled for all requests at once are bit-identical to per-request pooling."""
    new, _ = pair
    attn = next(layer.attn for layer in new.layers if layer.attn.indexer is not None)
    compressor = attn.compressor if kind == "compressor" else attn.indexer.compressor
    seq_lens, lengths = [1, 6, 1, 9], [3, 5, 8, 0]  # request 0 completes a window, 2 does not, ...
    states = [new.new_state() for _ in seq_lens]
    caches = [getattr(s.layers[1], kind) for s in states]
    g = torch.Generator().manual_seed(11)
    width = caches[0].rows()[0].shape[-1]
    for cache, n in zip(caches, lengths):  # histories of n rows (< one window of entries pooled)
        compressor.update(cache, torch.randn(n, width, generator=g), torch.randn(n, width, generator=g), attn.rope)
    for state, n in zip(states, lengths):
        state._tokens.append(torch.zeros(n, dtype=torch.long))
    batch = plan_batch(torch.zeros(sum(seq_lens), dtype=torch.long), states, seq_lens, len(new.layers), "cpu")
    alone = copy.deepcopy(caches)  # after plan_batch: it prunes the rows no future entry pools
    kv, score = torch.randn(sum(seq_lens), width, generator=g), torch.randn(sum(seq_lens), width, generator=g)
    compressor.update_batch(caches, kv, score, batch, attn.rope)
    for b, cache in enumerate(alone):
        compressor.update(cache, kv[batch.rows(b)], score[batch.rows(b)], attn.rope)
    assert [c.n_entries for c in caches] == [c.n_entries for c in alone] == [1, 2, 2, 2]
    for a, b in zip(caches, alone):
        assert torch.equal(a.entries(), b.entries()) and all(map(torch.equal, a.rows(), b.rows()))


@pytest.mark.gpu
def test_batched_attention_equals_per_request_path_on_gpu(tiny):
    """Same comparison with the fused kernels on the GPU (fp32): the batched call is one launch of
    the Triton attention and the padded torch indexer pass; the per-request path runs the fused
    indexer op per request."""
    from dspark.kernels import KernelConfig

    new = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(tiny()), device="cuda",
                                kernels=KernelConfig.uniform("triton")).init_weights(seed=3).eval()
    old = per_request_model(new)
    states = {m: [m.new_state() for _ in HISTORIES] for m in (new, old)}
    g = torch.Generator().manual_seed(0)
    fed = [b for b, n in enumerate(HISTORIES) if n]
    calls = [(fed, [HISTORIES[b] for b in fed])] + [(range(len(HISTORIES)), [1] * 5)] * 12
    worst = 0.0
    for requests, seq_lens in calls:
        ids = torch.randint(0, 256, (sum(seq_lens),), generator=g).cuda()
        with torch.inference_mode():
            a, b = (m(ids, [states[m][r] for r in requests], list(seq_lens)).logits for m in (new, old))
        worst = max(worst, rel_diff(a, b))
    print(f"[batched attention, GPU fp32] max relative |Δ| of logits: {worst:.3e}")
    assert worst <= 1e-4
