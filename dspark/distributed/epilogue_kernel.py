"""The Triton kernel of `fused_allreduce.moe_epilogue` (its torch reference: `moe_epilogue_ref` there).

A module of its own so that Triton is imported only when the fused epilogue first runs.
"""

from dspark.kernels.triton_compat import jit, tl


@jit
def _rank_sum(ptr, offs, inside, rank_stride, RANKS: tl.constexpr):
    """Σ_r ptr[r·rank_stride + offs] in fp32, ranks in ascending order (the fixed order every rank uses)."""
    acc = tl.load(ptr + offs, mask=inside, other=0.0)
    for r in tl.static_range(1, RANKS):
        acc += tl.load(ptr + r * rank_stride + offs, mask=inside, other=0.0)
    return acc


@jit
def epilogue_kernel(slots_ptr, ids_ptr, weights_ptr, out_ptr, dim, rank_stride,
                     K: tl.constexpr, K_PAD: tl.constexpr, RANKS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (n, c): token n, columns [c·BLOCK_D, (c+1)·BLOCK_D). slots [t, N·(K+1), D] fp32,
    ids [N, K], weights [N, K] fp32, out [N, D]."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < dim
    k = tl.arange(0, K_PAD)
    valid = k < K
    ids = tl.load(ids_ptr + n * K + k, mask=valid, other=0)
    w = tl.load(weights_ptr + n * K + k, mask=valid, other=0.0)
    # Position of slot k in ascending (expert id, slot) order: the stable argsort of the reference.
    earlier = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (k[None, :] < k[:, None]))
    before = valid[None, :] & earlier  # [K_PAD, K_PAD]: slot k' (column) sorts before slot k (row)
    pos = tl.sum(before.to(tl.int32), axis=1)  # [K_PAD]
    out_ty = out_ptr.dtype.element_ty
    row0 = n * (K + 1)
    routed = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        hit = (pos == j) & valid
        slot = tl.sum(tl.where(hit, k, 0), axis=0)
        g = tl.sum(tl.where(hit, w, 0.0), axis=0)  # the one hit plus zeros: exact
        expert = _rank_sum(slots_ptr, (row0 + slot) * dim + cols, inside, rank_stride, RANKS)
        routed += expert.to(out_ty).to(tl.float32) * g
    shared = _rank_sum(slots_ptr, (row0 + K) * dim + cols, inside, rank_stride, RANKS)
    y = routed + shared.to(out_ty).to(tl.float32)
    tl.store(out_ptr + n * dim + cols, y.to(out_ty), mask=inside)
