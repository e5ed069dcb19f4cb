"""`sparse_attention` on flashinfer (dspark/kernels/attention_flashinfer.py) against the reference.

On the CPU: the CSR key lists built from `index`, the argument checks, and the registry's rules for
the "flashinfer" implementation. On a GPU with flashinfer installed: the op (sink from the LSE, rows
without keys, −1 holes) against `sparse_attention_ref` at V4 shapes (head_dim 512, bf16).
"""

import pytest
import torch

from dspark.kernels import KernelConfig, attention_flashinfer, attention_ref, get_op, triton_available
from dspark.kernels.attention_flashinfer import KeyLists, SparseAttentionFlashinfer

from test_sparse_attention import DEVICE, make_inputs, rel_err

needs_flashinfer = pytest.mark.skipif(not attention_flashinfer.flashinfer_available(),
                                      reason="flashinfer not installed; pip install -e '.[flashinfer]'")


def test_key_lists_drop_holes_and_keep_one_filler_for_empty_rows():
    index = torch.tensor([[5, -1, 7, 2], [-1, -1, -1, -1], [0, 3, -1, -1], [9, 8, 6, 4]])
    keys = KeyLists.from_index(index)
    assert keys.indices.dtype == keys.indptr.dtype == keys.lengths.dtype == torch.int32
    assert keys.lengths.tolist() == [3, 0, 2, 4]
    assert keys.listed.tolist() == [3, 1, 2, 4]  # the empty row lists pool row 0 once
    assert keys.indptr.tolist() == [0, 3, 4, 6, 10]
    assert keys.indices.tolist() == [5, 7, 2, 0, 0, 3, 9, 8, 6, 4]


def test_key_lists_of_the_model_index_cover_every_key():
    _, _, index, _ = make_inputs(6, 4, 32, 37, 16, 30, 12, torch.float32, seed=3)
    index = index.cpu()
    keys = KeyLists.from_index(index)
    for row in range(index.shape[0]):
        listed = keys.indices[keys.indptr[row]:keys.indptr[row + 1]].tolist()
        assert sorted(listed) == sorted(index[row][index[row] >= 0].tolist())


def test_unsupported_inputs_name_the_bad_value():
    q, pool, index, sink = (t.cpu() for t in make_inputs(2, 4, 32, 10, 8, 0, 0, torch.float32, seed=1))
    op = SparseAttentionFlashinfer()
    with pytest.raises(ValueError, match="CUDA"):
        op(q, pool, index, sink, 0.2)
    with pytest.raises(ValueError, match="sink"):  # the reference's own argument checks come first
        op(q, pool, index, sink[:2], 0.2)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="head_dim 512"):
            op(q.cuda().bfloat16(), pool.cuda().bfloat16(), index.cuda(), sink.cuda(), 0.2)
        with pytest.raises(ValueError, match="float32"):
            op(q.cuda(), pool.cuda(), index.cuda(), sink.cuda(), 0.2)


def test_registry_offers_flashinfer_only_where_it_exists():
    op = get_op(KernelConfig(sparse_attention="flashinfer"), "sparse_attention")
    assert isinstance(op, SparseAttentionFlashinfer)
    assert get_op(KernelConfig(sparse_attention="flashinfer"), "sparse_attention") is not op  # no shared state
    with pytest.raises(ValueError, match="fused_moe='flashinfer'"):
        KernelConfig(fused_moe="flashinfer")
    assert KernelConfig.for_device("cuda").sparse_attention != "flashinfer"  # never a default


def test_run_before_plan_is_an_error():
    with pytest.raises(ValueError, match="plan"):
        SparseAttentionFlashinfer().run(torch.zeros(1, 2, 512), torch.zeros(3, 512), torch.zeros(2))


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("n_q,n_heads,start,n_entries,top_k", [
    (1, 64, 32767, 8192, 512),  # V4-Flash CSA decode at 32K
    (4, 32, 4000, 1000, 0),  # v4-mini HCA verify block
    (3, 16, 0, 0, 0),  # first tokens: window keys only, −1 before position 0
    (64, 64, 500, 2000, 128),  # many rows, holes in the picks
])
def test_matches_reference_on_gpu(n_q, n_heads, start, n_entries, top_k):
    q, pool, index, sink = make_inputs(n_q, n_heads, 512, start, 128, n_entries, top_k, torch.bfloat16,
                                       seed=n_q + n_heads)
    op = get_op(KernelConfig(sparse_attention="flashinfer"), "sparse_attention")
    out = op(q, pool, index, sink, 512 ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, attention_ref.sparse_attention_ref(q, pool, index, sink, 512 ** -0.5)) < 1e-2


@pytest.mark.gpu
@needs_flashinfer
def test_rows_without_keys_give_zero_on_gpu():
    q, pool, index, sink = make_inputs(3, 16, 512, 10, 128, 0, 0, torch.bfloat16, seed=2)
    index[1] = -1
    out = SparseAttentionFlashinfer()(q, pool, index, sink, 512 ** -0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = attention_ref.sparse_attention_ref(q, pool, index, sink, 512 ** -0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
@pytest.mark.parametrize("n_q,n_heads,head_dim,dtype", [(3, 4, 32, torch.float32), (2, 20, 160, torch.bfloat16),
                                                        (5, 64, 512, torch.bfloat16)])
def test_sink_epilogue_matches_its_reference(n_q, n_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(n_heads)
    out = torch.randn(n_q, n_heads, head_dim, generator=g).to(DEVICE, dtype)
    lse = (torch.randn(n_q, n_heads, generator=g) * 3).to(DEVICE)
    sink = torch.randn(n_heads, generator=g).to(DEVICE)
    lengths = torch.tensor([7, 0, 3, 1, 9][:n_q], dtype=torch.int32, device=DEVICE)
    expected = attention_flashinfer.apply_sink_ref(out.clone(), lse, sink, lengths)
    got = attention_flashinfer.apply_sink(out, lse, sink, lengths)
    assert got.data_ptr() == out.data_ptr()  # in place
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert rel_err(got, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
