"""Torch reference of `sparse_attention` (see `attention.py` for the op and its fused kernel).

Kept apart from the kernel module so that the model imports it without importing Triton.
"""

from __future__ import annotations

import torch

from dspark.kernels.norm_rope_ref import norm_rope_ref

# The reference processes queries in chunks so that the gathered keys [S_chunk, K, d] (fp32) stay
# below this many elements: a long prefill would otherwise gather S·(W + top-k)·d values at once.
_REF_CHUNK_ELEMENTS = 1 << 26


def _check_args(q, pool, index, sink) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [S, H, d], got shape {tuple(q.shape)}")
    n_q, n_heads, head_dim = q.shape
    if pool.dim() != 2 or pool.shape[1] != head_dim:
        raise ValueError(f"pool must be [P, d={head_dim}], got {tuple(pool.shape)}")
    if index.dim() != 2 or index.shape[0] != n_q or index.dtype.is_floating_point:
        raise ValueError(f"index must be an integer [S={n_q}, K] tensor, got {tuple(index.shape)} {index.dtype}")
    if tuple(sink.shape) != (n_heads,):
        raise ValueError(f"sink must be [H={n_heads}], got {tuple(sink.shape)}")


def sparse_attention_ref(q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Attention of each query over its own key list, with a per-head sink (spec §7.4).

    Shape: q [S, H, d]; pool [P, d] shared K = V rows; index [S, K] int rows of `pool` per query,
    −1 = empty; sink [H] fp32 logits that join each softmax denominator only. Scores, softmax and
    the weighted sum run in fp32. Returns [S, H, d] in q's dtype.
    """
    _check_args(q, pool, index, sink)
    n_keys = max(index.shape[1], 1)
    chunk = max(1, _REF_CHUNK_ELEMENTS // (n_keys * pool.shape[-1]))
    out = [_ref_chunk(q[i : i + chunk], pool, index[i : i + chunk], sink, scale)
           for i in range(0, q.shape[0], chunk)]
    return torch.cat(out).to(q.dtype)


def _ref_chunk(q, pool, index, sink, scale):
    keys = pool[index.clamp(min=0)].float()  # [S, K, d]
    scores = torch.einsum("shd,skd->shk", q.float(), keys) * scale
    scores = scores.masked_fill((index < 0).unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink takes mass, gives no value
    return torch.einsum("shk,skd->shd", probs, keys)


def _check_qnorm_args(q, cos, sin, eps) -> None:
    if q.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != q.shape[0] \
            or not 0 < 2 * cos.shape[1] <= q.shape[2]:
        raise ValueError(f"q [S, H, d] needs cos / sin [S, rd/2] with 0 < rd <= d, got q {tuple(q.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def sparse_attention_qnorm_ref(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                               index: torch.Tensor, sink: torch.Tensor, scale: float, *, eps: float) -> torch.Tensor:
    """`sparse_attention_ref` of V4's raw q heads: each head RMS-normalised (unweighted, `eps`) and its trailing
    rd = 2·cos.shape[-1] dims rotated by its row's cos / sin [S, rd/2] first (`norm_rope_ref`, the model's
    former code), then attended. q [S, H, d] (wq_b's output) -> [S, H, d] in q's dtype."""
    _check_qnorm_args(q, cos, sin, eps)
    q = norm_rope_ref(q, None, cos.unsqueeze(-2), sin.unsqueeze(-2), eps=eps)
    return sparse_attention_ref(q, pool, index, sink, scale)
