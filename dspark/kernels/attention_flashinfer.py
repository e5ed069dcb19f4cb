"""`sparse_attention` on flashinfer's MLA paged-attention kernels (FA3 on Hopper): an optional backend.

V4's attention is shared-KV MQA over an explicit key list per query (`attention.py`). flashinfer's
MLA decode kernels compute the same thing when each query row is its own "request", its key list is
that request's page table with one key per page (page_size 1), the 512-dim latents are the `ckv`
cache (both keys and values, as in MLA with the absorbed projections) and the RoPE part is empty
(head_dim_kpe 0: V4 rotates inside the 512 dims). They ignore attention sinks; the sink joins the
softmax denominator only, so it is applied afterwards from the log-sum-exp the kernel returns:

    out_with_sink = out · e^lse / (e^lse + e^sink) = out · sigmoid(lse − sink).

The sink is one Triton pass over the output (`apply_sink`, in place; `apply_sink_ref` is its torch
reference): a chain of torch ops there costs more than flashinfer's kernel at decode sizes.

Planning is host work: flashinfer schedules the key lists over the SMs from their lengths, which this
op reads from `index` (one host sync per call). `plan` and `run` are separate so a caller that knows
the lengths, or times the device work alone (`bench/attn_batched.py`), can plan once.

Constraints (each raises a ValueError naming the value): CUDA tensors, bf16 or fp16, head_dim 512
(flashinfer compiles the MLA kernels for 512-dim latents only). flashinfer is an optional
dependency (the `flashinfer` extra); `flashinfer_available()` says whether it imports.
The kernels are compiled by flashinfer's JIT on first use (needs nvcc), then cached on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dspark.kernels.attention_ref import _check_args, sparse_attention_ref  # noqa: F401 (the op's ref)
from dspark.kernels.registry import package_available, require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton

HEAD_DIM = 512  # the MLA kernels' latent width (flashinfer: head_dim_ckv)
WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended split-KV workspace


def flashinfer_available() -> bool:
    """True when `import flashinfer` succeeds."""
    return package_available("flashinfer")


def require_flashinfer() -> None:
    if not flashinfer_available():
        raise ImportError("the 'flashinfer' sparse_attention needs flashinfer: pip install -e '.[flashinfer]' "
                          "(or choose impl 'triton' / 'ref' in KernelConfig)")


def check_supported(q: torch.Tensor, pool: torch.Tensor) -> None:
    """The shapes and dtypes flashinfer's MLA kernels take; a ValueError naming what is not."""
    if q.device.type != "cuda" or pool.device != q.device:
        raise ValueError(f"flashinfer sparse_attention runs on CUDA tensors, got q on {q.device}, pool on "
                         f"{pool.device}")
    if q.dtype not in (torch.bfloat16, torch.float16) or pool.dtype != q.dtype:
        raise ValueError(f"flashinfer sparse_attention takes bf16 or fp16 q and pool of one dtype, got "
                         f"{q.dtype} and {pool.dtype}")
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"flashinfer sparse_attention needs head_dim {HEAD_DIM}, got {q.shape[-1]}")


@_jit
def _sink_kernel(out_ptr, lse_ptr, sink_ptr, len_ptr, n_heads, head_dim,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[s, heads of block, :] *= sigmoid(lse − sink), 0 where row s has no keys."""
    s = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < n_heads
    lse = tl.load(lse_ptr + s * n_heads + offs_h, mask=h_mask, other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    weight = 1.0 / (1.0 + tl.exp(sink - lse))
    weight = tl.where(tl.load(len_ptr + s) > 0, weight, 0.0)
    rows = (s * n_heads + offs_h)[:, None] * head_dim
    for d0 in range(0, head_dim, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
        out = tl.load(out_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows + offs_d[None, :], (out * weight[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def apply_sink_ref(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """out [S, H, d] (softmax over the keys only), lse [S, H] fp32 natural-log, sink [H], lengths [S]
    -> out · sigmoid(lse − sink) in out's dtype, 0 for rows without keys (in place, returned)."""
    weight = torch.sigmoid(lse - sink.float()).masked_fill((lengths == 0).unsqueeze(-1), 0.0)
    return out.copy_(out.float() * weight.unsqueeze(-1))


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`apply_sink_ref` as one Triton pass (same signature; out contiguous, modified in place)."""
    require_triton()
    n_q, n_heads, head_dim = out.shape
    if n_q:
        block_h = min(16, triton.next_power_of_2(n_heads))
        _sink_kernel[(n_q, triton.cdiv(n_heads, block_h))](
            out, lse.contiguous(), sink.contiguous(), lengths.contiguous(), n_heads, head_dim,
            BLOCK_H=block_h, BLOCK_D=min(128, triton.next_power_of_2(head_dim)), num_warps=4)
    return out


@dataclass(frozen=True)
class KeyLists:
    """The key lists of `index` [S, K] (−1 = no key) in flashinfer's CSR form, on the device:
    `indices` [nnz] int32 (row-major, −1s dropped), `indptr` [S + 1], `listed` [S] int32 list
    lengths, `lengths` [S] the true key counts. A row without keys lists pool row 0 once (flashinfer
    plans no empty list) and its output is zeroed from `lengths`."""

    indices: torch.Tensor
    indptr: torch.Tensor
    listed: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_index(cls, index: torch.Tensor) -> KeyLists:
        lengths = (index >= 0).sum(dim=1, dtype=torch.int32)
        filler = torch.where(lengths == 0, 0, -1).to(index.dtype).unsqueeze(1)  # [S, 1]
        index = torch.cat((index, filler), dim=1)
        valid = index >= 0
        listed = valid.sum(dim=1, dtype=torch.int32)
        indptr = torch.nn.functional.pad(listed.cumsum(0, dtype=torch.int32), (1, 0))
        return cls(index[valid].to(torch.int32), indptr, listed, lengths)


class _Plan(NamedTuple):
    """What `run` must match: the query rows and heads, the dtype, and the rows' true key counts."""

    n_q: int
    n_heads: int
    dtype: torch.dtype
    lengths: torch.Tensor


class SparseAttentionFlashinfer:
    """`sparse_attention(q, pool, index, sink, scale)` on flashinfer (module docstring).

    Each instance holds one flashinfer wrapper and its workspaces (made on the first call, on that
    call's device), so two models never share planning state.
    """

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.workspace_bytes = workspace_bytes
        self._wrapper = None
        self._planned: _Plan | None = None

    def _get_wrapper(self, device: torch.device):
        if self._wrapper is None or self._wrapper.device != device:
            require_flashinfer()
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
            self._wrapper = BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        return self._wrapper

    def plan(self, index: torch.Tensor, n_heads: int, scale: float, dtype: torch.dtype) -> KeyLists:
        """Schedule the key lists of `index` [S, K] (host work, one sync); returns them."""
        keys = KeyLists.from_index(index)
        n_q = index.shape[0]
        qo_indptr = torch.arange(n_q + 1, dtype=torch.int32, device=index.device)  # one query row per list
        wrapper = self._get_wrapper(index.device)
        wrapper.plan(qo_indptr, keys.indptr, keys.indices, keys.listed, n_heads, HEAD_DIM, 0, 1, False,
                     float(scale), dtype, dtype)
        self._planned = _Plan(n_q, n_heads, dtype, keys.lengths)
        return keys

    def run(self, q: torch.Tensor, pool: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        """The planned attention of q [S, H, 512] over pool [P, 512], sink [H] applied: [S, H, 512].
        Device work only (no host sync): CUDA-graph capturable once planned."""
        plan = self._planned
        if plan is None or (plan.n_q, plan.n_heads, plan.dtype) != (q.shape[0], q.shape[1], q.dtype):
            raise ValueError(f"run: q {tuple(q.shape)} {q.dtype} does not match the plan "
                             f"{plan and (plan.n_q, plan.n_heads, plan.dtype)}")
        # Rows without keys: the reference gives 0 (all mass on the sink); flashinfer leaves them undefined.
        return apply_sink(*self.kernel(q, pool), sink, plan.lengths)

    def kernel(self, q: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flashinfer's planned kernel alone: (out [S, H, 512] without the sink, lse [S, H] fp32,
        natural log). `run` adds the sink; the bench times this part by itself."""
        empty_q = q.new_empty((*q.shape[:2], 0))
        empty_kpe = pool.new_empty((pool.shape[0], 1, 0))
        return self._wrapper.run(q.contiguous(), empty_q, pool.contiguous().view(pool.shape[0], 1, HEAD_DIM),
                                 empty_kpe, return_lse=True, return_lse_base_on_e=True)

    def __call__(self, q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, sink: torch.Tensor,
                 scale: float) -> torch.Tensor:
        _check_args(q, pool, index, sink)
        check_supported(q, pool)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        self.plan(index, q.shape[1], scale, q.dtype)
        return self.run(q, pool, sink)
