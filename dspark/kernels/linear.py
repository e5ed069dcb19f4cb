"""Few-row linear layers: y = x·Wᵀ for decode and verify calls, streaming the weight once.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``linear(x, weight) -> y``: x [..., K], weight [N, K] (no bias) -> y [..., N] in x.dtype.

A decode step multiplies a handful of rows by every dense weight of the model: the time is the
weight's bytes, and cuBLAS's small-M kernels left most of the bandwidth unused on the H200
(`bench/results/graph-profile-h200-not-yet.json`: the q/kv/out projections of a one-token v4-mini
step at 16-38 % of HBM). Two kernels, both one launch with no host sync:

* one row (`_gemv_kernel`): program n streams BLOCK_N weight rows in BLOCK_K-wide tiles and reduces
  each against x on the CUDA cores (fp32); small BLOCK_N spreads a short N over many SMs;
* 2..ROWS_MAX rows (`_skinny_kernel`): a 16-row tensor-core tile (tl.dot, fp32 accumulation) per
  BLOCK_N weight rows, so each weight tile is read once for every row.

Above ROWS_MAX rows (prefill) the op is torch's matmul: there the GEMM is compute-bound and cuBLAS's
tiles are the right tool. Shape symbols: M rows of x, K in-features, N out-features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels.autograd import records_grad
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)

ROWS_MAX = 16  # one tensor-core tile of rows; larger calls go to torch's matmul


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] must match weight [N, K] = {tuple(weight.shape)}, got x {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ -> [..., N] (torch's matmul)."""
    _check_args(x, weight)
    return F.linear(x, weight)


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_out, n_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = Σ_k x[k]·w[n, k] for the BLOCK_N rows of program n, fp32 sums."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    rows = offs_n.to(tl.int64)[:, None] * n_in
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < n_in
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]  # one reduction after the loop, not one per tile
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)


@_jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_out, n_in,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """y[:M, n-block] for M <= 16 rows: [16, BLOCK_K] × [BLOCK_K, BLOCK_N] tensor-core tiles."""
    offs_m = tl.arange(0, 16)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < n_rows
    n_mask = offs_n < n_out
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < n_in
        x = tl.load(x_ptr + offs_m[:, None] * n_in + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * n_in + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + offs_m[:, None] * n_out + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# ------------------------------------------------------------------------------------- launchers


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # Triton interpreter on CPU: few programs keep it fast


def gemv_tiles(n_out: int, n_in: int, n_sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of `_gemv_kernel`: K tiles up to 1024 wide, 8192-element weight tiles
    (16 KB of bf16 in flight per program and step), and BLOCK_N small enough that the grid has about
    two programs per SM when N allows."""
    block_k = min(1024, max(16, triton.next_power_of_2(n_in)))
    block_n = max(1, 8192 // block_k)
    while block_n > 1 and triton.cdiv(n_out, block_n) < 2 * n_sms:
        block_n //= 2
    return block_n, block_k, 8 if block_n * block_k >= 8192 else 4


def skinny_tiles(n_out: int, n_in: int, n_sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of `_skinny_kernel`: 16..64 weight rows per program (tl.dot
    needs 16), fewer when that leaves SMs idle."""
    block_k = min(256, max(16, triton.next_power_of_2(n_in)))
    block_n = 64
    while block_n > 16 and triton.cdiv(n_out, block_n) < 2 * n_sms:
        block_n //= 2
    return block_n, block_k, 4, 4


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Fused `linear_ref` (same signature): the few-row kernels up to ROWS_MAX rows, torch above."""
    return launch_linear(x, weight)


def launch_linear(x: torch.Tensor, weight: torch.Tensor, tiles: tuple | None = None) -> torch.Tensor:
    """`linear` with explicit `tiles` (`gemv_tiles` shape for one row, `skinny_tiles` shape for more;
    the bench sweeps them, the model uses the defaults)."""
    _check_args(x, weight)
    rows = x.numel() // max(1, x.shape[-1])
    if rows > ROWS_MAX or rows == 0 or records_grad(x, weight):  # the kernels have no backward
        return F.linear(x, weight)
    require_triton()
    n_out, n_in = weight.shape
    x2 = x.reshape(rows, n_in).contiguous()
    weight = weight.contiguous()
    y = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    n_sms = _num_sms(x.device)
    if rows == 1:
        block_n, block_k, warps = tiles or gemv_tiles(n_out, n_in, n_sms)
        _gemv_kernel[(triton.cdiv(n_out, block_n),)](x2, weight, y, n_out, n_in, BLOCK_N=block_n,
                                                       BLOCK_K=block_k, num_warps=warps)
    else:
        block_n, block_k, warps, stages = tiles or skinny_tiles(n_out, n_in, n_sms)
        _skinny_kernel[(triton.cdiv(n_out, block_n),)](x2, weight, y, rows, n_out, n_in, BLOCK_N=block_n,
                                                         BLOCK_K=block_k, DOT_FP32=x.dtype == torch.float32,
                                                         num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n_out)
