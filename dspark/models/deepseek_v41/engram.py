"""Engram, DeepSeek-V4.1's hashed n-gram memory (deepseek_v41 spec §8.4), added to the residual
streams before layers 1 and 14 of V4.1-Flash.

Per token, with its C = 24 hash columns (§8.3) and streams X [hc, D]:

    E     = table[columns]                     [C, hd]   -> flattened [C·hd]
    K | V = wkv · E                            keys first: K [hc, D] (one per stream), V [D]
    dot_s = Σ_d X_s·(q ⊙ k)_s·K_s · rsqrt(mean X_s² + ε) · rsqrt(mean K_s² + ε) / √D
    g_s   = σ(sign(dot_s) · sqrt(max(|dot_s|, 1e-6)))          0 for image-span tokens
    X_s  += g_s · V                            fp32, one cast back

The normalisation is per (token, stream) over D, not joint over the streams; `q_weight` and
`k_weight` are only ever used as their product. V4.1 dropped the short convolution of the
original Engram. Tables are ~98 GB each in the release, so `EngramTable` can live in host memory
(pinned when CUDA is available): its lookups depend only on token ids, so the model issues them
for all Engram layers before layer 0 runs (spec §8.5). The gate and the blend after `wkv` are the
registry's `engram_gate` op (dspark/kernels/engram_gate.py: one launch on Triton).

Shape symbols: N tokens, hc streams, D hidden size, C hash columns, hd table row width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels import KernelConfig, get_op


class EngramTable(nn.Module):
    """One layer's hash table, `weight` [rows, hd] (checkpoint key `engram.embed.weight`; FP8 with
    1×32 UE8M0 scales on disk, dequantised at load). `host=True` keeps it in CPU memory, pinned
    when CUDA is available so its row copies to the device can run asynchronously."""

    def __init__(self, rows: int, dim: int, dtype=None, device=None, host: bool = False):
        super().__init__()
        self.host = host
        if host:
            weight = torch.empty(rows, dim, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())
        else:
            weight = torch.empty(rows, dim, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight)

    def lookup(self, columns: torch.Tensor, device: torch.device) -> torch.Tensor:
        """columns [N, C] long (on any device) -> rows [N, C, hd] on `device`."""
        columns = columns.to(self.weight.device)
        if not self.weight.is_pinned() or (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.embedding(columns, self.weight).to(device)  # autograd cannot record `out=` below
        # Gather into pinned memory so that the copy to the device is asynchronous (it is still
        # ordered before any use on the device's stream).
        rows = torch.empty((columns.numel(), self.weight.shape[1]), dtype=self.weight.dtype, pin_memory=True)
        torch.index_select(self.weight, 0, columns.flatten(), out=rows)
        return rows.view(*columns.shape, -1).to(device, non_blocking=True)


class Engram(nn.Module):
    """Parameters (checkpoint names, Flash sizes): `embed` (table [384 006 168, 256]),
    `wkv` [(hc+1)·D, C·hd] = [25600, 6144], `q_weight`, `k_weight` [hc, D] = [4, 5120]."""

    def __init__(self, config, table_rows: int, dtype=None, device=None, host_table: bool = False,
                 kernels: KernelConfig | None = None):
        super().__init__()
        self.gate_op = get_op(KernelConfig() if kernels is None else kernels, "engram_gate")
        c = config
        self.hc_mult = c.hc_mult
        self.hidden_size = c.hidden_size
        self.eps = c.rms_norm_eps
        n_columns = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        self.embed = EngramTable(table_rows, c.engram_head_dim, dtype=dtype, device=device, host=host_table)
        self.wkv = nn.Linear(n_columns * c.engram_head_dim, (c.hc_mult + 1) * c.hidden_size, bias=False,
                             dtype=dtype, device=device)
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, dtype=dtype, device=device))
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """x [N, hc, D] streams, rows [N, C, hd] looked-up table rows, live [N] bool (False: image
        token, gate shut) or None -> streams [N, hc, D] with the gated value added."""
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # [N, (hc+1)·D]: keys per stream, value
        return self.gate_op(x, kv, self.q_weight, self.k_weight, live, eps=self.eps)
