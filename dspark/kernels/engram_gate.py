"""V4.1's Engram gate (deepseek_v41 spec §6): the gated value added to every stream, in one launch.

Op (`engram_gate` is Triton, `engram_gate_ref` is torch, same signature):

* ``engram_gate(x, kv, q_weight, k_weight, live, *, eps) -> y``: with h = x and k = kv's first hc·D
  columns (one key per stream), v = its last D columns (one value per token), w = q_weight ⊙ k_weight,
      dot_j  = Σ_d h_j w_j k_j · rsqrt(mean(h_j²) + eps) · rsqrt(mean(k_j²) + eps) · D^-½
      gate_j = sigmoid(sign(dot_j) · sqrt(max(|dot_j|, 1e-6))) · live
      y_j    = h_j + gate_j · v                                   (j = 1 .. hc, fp32, one cast)

Shape: x [N, hc, D] bf16/fp32; kv [N, (hc + 1)·D] (the Engram's `wkv` output); q_weight, k_weight
[hc, D]; live [N] bool (False: an image token, gate shut) or None; y [N, hc, D] in x.dtype.

The reference is `Engram.forward`'s former torch code (about 20 elementwise and reduction kernels
per layer). The fused kernel runs one program per token: its hc rows' three sums over D (Σh², Σk²,
Σ h·w·k) in fp32, the gates, then the blended rows; the sums reduce in another order, so results
agree to fp32 rounding (then one bf16 rounding). No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.autograd import records_grad
from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

GATE_FLOOR = 1e-6  # |dot| floor under the square root: the gradient of sqrt is unbounded at 0 (training)
_BLOCK_D = 1024


def _check_args(x, kv, q_weight, k_weight, live) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [N, hc, D], got shape {tuple(x.shape)}")
    n, hc, dim = x.shape
    if tuple(kv.shape) != (n, (hc + 1) * dim):
        raise ValueError(f"kv must be [N, (hc + 1)·D] = {(n, (hc + 1) * dim)}, got {tuple(kv.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (hc, dim):
            raise ValueError(f"{name} must be [hc, D] = {(hc, dim)}, got {tuple(w.shape)}")
    if live is not None and (live.dtype != torch.bool or tuple(live.shape) != (n,)):
        raise ValueError(f"live must be a bool [N={n}] tensor or None, got {live.dtype} {tuple(live.shape)}")


def engram_gate_ref(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    live: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    """The gated Engram value added to each stream (module docstring), torch ops in fp32."""
    _check_args(x, kv, q_weight, k_weight, live)
    hc, dim = x.shape[1:]
    key, value = kv.split([hc * dim, dim], dim=-1)
    key = key.float().unflatten(-1, (hc, dim))  # [N, hc, D]
    h = x.float()
    weight = q_weight.float() * k_weight.float()  # [hc, D]
    scale = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * scale * dim**-0.5  # [N, hc]
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=GATE_FLOOR).sqrt())
    if live is not None:
        gate = gate * live.unsqueeze(-1)
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)


@_jit
def _engram_gate_kernel(x_ptr, kv_ptr, qw_ptr, kw_ptr, live_ptr, y_ptr, dim, eps, inv_sqrt_dim, floor,
                        HC: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Token n = program 0: its HC gates from three fp32 sums per stream, then y = x + gate · v."""
    pdl_prologue(PDL)
    n = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + n * HC * dim
    kv_row = kv_ptr + n * (HC + 1) * dim
    y_row = y_ptr + n * HC * dim
    cols = tl.arange(0, BLOCK_D)
    live = tl.load(live_ptr + n).to(tl.float32) if HAS_LIVE else 1.0
    for j in tl.static_range(HC):
        sq_h = tl.zeros((BLOCK_D,), tl.float32)
        sq_k = tl.zeros((BLOCK_D,), tl.float32)
        dots = tl.zeros((BLOCK_D,), tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            mask = d0 + cols < dim
            h = tl.load(x_row + j * dim + d0 + cols, mask=mask, other=0.0).to(tl.float32)
            k = tl.load(kv_row + j * dim + d0 + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(qw_ptr + j * dim + d0 + cols, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(kw_ptr + j * dim + d0 + cols, mask=mask, other=0.0).to(tl.float32)
            sq_h += h * h
            sq_k += k * k
            dots += h * w * k
        scale = tl.math.rsqrt(tl.sum(sq_h, axis=0) / dim + eps) * tl.math.rsqrt(tl.sum(sq_k, axis=0) / dim + eps)
        dot = tl.sum(dots, axis=0) * scale * inv_sqrt_dim
        root = tl.sqrt(tl.maximum(tl.abs(dot), floor))
        gate = tl.sigmoid(tl.where(dot > 0, root, tl.where(dot < 0, -root, 0.0))) * live
        for d0 in range(0, dim, BLOCK_D):
            mask = d0 + cols < dim
            h = tl.load(x_row + j * dim + d0 + cols, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(kv_row + HC * dim + d0 + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + j * dim + d0 + cols, (h + gate * v).to(y_ptr.dtype.element_ty), mask=mask)


def engram_gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                live: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    """`engram_gate_ref` in one launch (same signature; module docstring)."""
    require_triton()
    _check_args(x, kv, q_weight, k_weight, live)
    if records_grad(x, kv, q_weight, k_weight):  # training: the kernel has no backward
        return engram_gate_ref(x, kv, q_weight, k_weight, live, eps=eps)
    n, hc, dim = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n:
        x, kv = x.contiguous(), kv.contiguous()
        pdl = pdl_launch(x.device, n)
        _engram_gate_kernel[(n,)](
            x, kv, q_weight.contiguous(), k_weight.contiguous(), x if live is None else live.contiguous(), y,
            dim, float(eps), dim**-0.5, GATE_FLOOR, HC=hc, HAS_LIVE=live is not None, BLOCK_D=min(_BLOCK_D, triton.next_power_of_2(dim)),
            PDL=pdl, launch_pdl=pdl, num_warps=4)
    return y
