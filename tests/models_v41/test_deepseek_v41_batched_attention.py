"""V4.1 batched attention (one `sparse_attention` call per layer for all requests, KV sources
publishing all requests' entries in one pass) against the per-request path it replaced
(`Attention.forward_per_request`, `publish_per_request`), on CPU in fp32.

Tiny config with every layer role (SWA, ratio 2 and ratio 1 KV sources, reuse layers, the candidate
source and a re-index layer); requests with different histories get decode steps, verify blocks
and a mixed call, in exact and bounded-replay prefill modes. Logits and the stored state must agree.
"""

import copy

import pytest
import torch

# Relative to each tensor's largest magnitude: key lists of a batch are padded with −1 columns to
# the longest request's, which changes the CPU GEMM's reduction blocking (a few fp32 ulps).
TOL = 2e-6
HISTORIES = (0, 3, 9, 17, 30)
CALLS = [[1] * 5] * 6 + [[3] * 5] * 2 + [[7, 1, 4, 1, 1]] + [[1] * 5] * 4  # decode, verify, mixed, decode


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) if b.numel() else 0.0


def max_state_diff(a, b) -> float:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.keys() == sb.keys()
    worst = 0.0
    for key, value in sa.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[key])), key
        else:
            assert value.shape == sb[key].shape, key
            worst = max(worst, rel_diff(value, sb[key]))
    return worst


@pytest.mark.parametrize("mode", ["exact", "bounded_replay"])
def test_batched_attention_equals_per_request_path(make_model, mode):
    new = make_model(seed=2, prefill_mode=mode)
    old = copy.deepcopy(new)
    for layer in old.layers:  # the old path: per-request attention and per-request publishing
        layer.attn.forward = layer.attn.forward_per_request
        if layer.attn.compressor is not None:
            layer.attn.publish = layer.attn.publish_per_request
    states = {m: [m.new_state() for _ in HISTORIES] for m in (new, old)}
    g = torch.Generator().manual_seed(0)
    fed = [b for b, n in enumerate(HISTORIES) if n]
    calls = [(fed, [HISTORIES[b] for b in fed])] + [(range(len(HISTORIES)), lens) for lens in CALLS]
    worst = 0.0
    for requests, seq_lens in calls:
        ids = torch.randint(0, 256, (sum(seq_lens),), generator=g)
        with torch.no_grad():
            logits = [m(ids, [states[m][b] for b in requests], list(seq_lens)).logits for m in (new, old)]
        worst = max(worst, rel_diff(*logits))
    for a, b in zip(states[new], states[old]):
        worst = max(worst, max_state_diff(a, b))
    print(f"[v41 batched attention, {mode}] max relative |Δ| of logits and state: {worst:.3e}")
    assert worst <= TOL


def test_one_attention_call_per_layer(make_model):
    model = make_model(seed=2)
    calls = []
    for layer in model.layers:
        op = layer.attn.attend_op
        layer.attn.attend_op = lambda *args, op=op: calls.append(args[0].shape[0]) or op(*args)
    states = [model.new_state() for _ in range(3)]
    with torch.no_grad():
        model(torch.arange(3 * 12) % 256, states, [12] * 3)
        model(torch.arange(3), states, [1] * 3)
    assert calls == [36] * len(model.layers) + [3] * len(model.layers)
