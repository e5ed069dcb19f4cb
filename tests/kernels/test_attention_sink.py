"""The attention sink after a sink-less kernel (dspark/kernels/attention_sink.py): the Triton pass
against its reference, and the reference's algebra: attention over the keys alone, then the sink
from its log-sum-exp, is the attention with the sink."""

import pytest
import torch

from dspark.kernels import attention_ref, triton_available
from dspark.kernels.attention_sink import SinkGate, apply_sink, apply_sink_ref, sink_factor, sparse_attention_lse_ref

from test_sparse_attention import DEVICE, make_inputs, rel_err


@pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
@pytest.mark.parametrize("n_q,n_heads,head_dim,dtype", [(3, 4, 32, torch.float32), (2, 20, 160, torch.bfloat16),
                                                        (5, 64, 512, torch.bfloat16)])
def test_sink_pass_matches_its_reference(n_q, n_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(n_heads)
    out = torch.randn(n_q, n_heads, head_dim, generator=g).to(DEVICE, dtype)
    lse = (torch.randn(n_q, n_heads, generator=g) * 3).to(DEVICE)
    sink = torch.randn(n_heads, generator=g).to(DEVICE)
    lengths = torch.tensor([7, 0, 3, 1, 9][:n_q], dtype=torch.int32, device=DEVICE)
    expected = apply_sink_ref(out.clone(), lse, sink, lengths)
    got = apply_sink(out, lse, sink, lengths)
    assert got.data_ptr() == out.data_ptr()  # in place
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert rel_err(got, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("top_k", [0, 6])
def test_keys_alone_then_the_sink_is_the_attention_with_it(top_k):
    q, pool, index, sink = (t.cpu() for t in make_inputs(6, 4, 32, 20, 8, 12, top_k, torch.float32, seed=top_k))
    index[3] = -1  # a row without keys: all mass on the sink, output 0
    out, lse = sparse_attention_lse_ref(q, pool, index, 0.3)
    lengths = (index >= 0).sum(dim=1)
    assert torch.isneginf(lse[3]).all() and torch.equal(out[3], torch.zeros_like(out[3]))
    sunk = apply_sink_ref(out, lse, sink, lengths)
    assert rel_err(sunk, attention_ref.sparse_attention_ref(q, pool, index, sink, 0.3)) < 1e-6


def test_factor_is_the_sinks_share_of_the_softmax():
    lse, sink = torch.tensor([[0.0, 2.0], [1.0, -1.0]]), torch.tensor([0.0, 1.0])
    factor = sink_factor(SinkGate(lse, sink, torch.tensor([3, 0])))
    assert torch.allclose(factor[0], torch.tensor([0.5, 1 / (1 + torch.e ** -1)]))
    assert torch.equal(factor[1], torch.zeros(2))  # no keys
