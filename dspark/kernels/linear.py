"""Few-row linear layers: y = x·Wᵀ for 1 to 8 decode rows, streaming the weight once.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``linear(x, weight) -> y``: x [..., K], weight [N, K] (no bias) -> y [..., N] in x.dtype.
* ``linear_scaled(x, weight, *, scale) -> y``: `linear` rounded to x.dtype as it returns it, then
  times `scale` in fp32 -> y [..., N] fp32: the indexers' head weights, weights_proj(x).float() · s,
  in one launch where the GEMV runs (three before: the GEMV, the cast, the product).
* ``linear_rope(x, weight, cos, sin, *, head_dim) -> q``: `linear`, its rows split into heads of `head_dim`
  and each head's trailing 2·cos.shape[-1] dims rotated as the `rope` op does; x [N, K], weight [H·d, K],
  cos / sin [N, rd/2] fp32 -> q [N, H, d] in x.dtype: the indexers' queries, rope(wq_b(q_lora)). With
  ROPE_EPILOGUE (a candidate, off) the rotation runs in `_gemv_kernel`'s epilogue where the GEMV runs (one
  launch instead of two); elsewhere the two ops, as the models called them before.
* ``compressor_project(x, wkv, wgate, ape, phase, *, kv_out=None, score_out=None, out_rows=None)
  -> (kv, score)``: a compressor's two projections and its position bias (deepseek_v4 spec §8.2): kv = x·wkvᵀ, score = x·wgateᵀ (rounded to x.dtype,
  as the model's linear returns it) + ape[phase] in fp32; x [N, K], wkv / wgate [W, K], ape
  [rate, W] fp32, phase [N] long -> kv [N, W] x.dtype, score [N, W] fp32. For 1 to 8 rows where the
  GEMV range holds (`project_pays`) one launch reads x once for both weights and adds the bias in its
  epilogue (otherwise two matmuls, a gather and an add: 4 launches per compressor, 15 compressors per
  v4-mini step). With destinations (``kv_out=`` [R, W] x.dtype, ``score_out=`` [R, W] fp32,
  ``out_rows=`` [N] long: a static state's rings viewed as rows) row i goes to row out_rows[i] of
  each and the op returns (kv_out, score_out): the kernel stores there itself (no `index_copy_`
  launches after it), the reference path copies.
* ``compressor_project_fp32(x, wkv, wgate, *, kv_out=None, gate_out=None, out_rows=None) -> (kv, gate)``:
  V4.1's compressor projections (deepseek_v41 spec §5.2: it pools in fp32, the bf16 weights promoted):
  kv = x·wkvᵀ and gate = x·wgateᵀ, both fp32 and unrounded; x [N, K] and the weights [W, K] in the model
  dtype. The same `_project_kernel` without the position bias, where `project_pays`; with
  destinations (fp32 [R, W] rings and out_rows [N] long) it stores there, as `compressor_project`.
  The reference is the model's former code: x and both weights cast to fp32 (two weight copies per
  call) and two fp32 matmuls, then two ring copies in the static step.

A batch-1 decode step multiplies one row by every dense weight of the model, and its small weights
are latency-bound: cuBLAS's one-row kernels took 4.4-12.3 µs for the 1-4 MB projections of v4-mini
on the H200, where `_gemv_kernel` (program n streams BLOCK_N weight rows in BLOCK_K-wide tiles and
reduces them against x on the CUDA cores, fp32) takes 2.8-4.1 µs. On larger weights, or short rows
(K = 512), cuBLAS was faster timed alone (`bench/results/linear-decode-h200.json`), so `linear` runs
the kernel where it won there or, for one row of 512, in the graph step (`gemv_pays`), and torch's
matmul everywhere else: the LM head, V4-Flash's q projections, and (GEMV_MAX_ROWS) every call of
more than four rows (a tensor-core 16-row tile variant measured 0.72-1.02× cuBLAS at 8 rows and was
dropped).

A verify step (a few tokens per request) or a decode step of a few requests has 2-8 rows: each
program then multiplies its weight tile with all M rows (ROWS = M rounded up to a power of two,
accumulators [ROWS, BLOCK_N, BLOCK_K] in fp32 on the CUDA cores; `tl.dot` needs 16 rows), so the
weight still streams once and the op stays bandwidth-bound.

Shape symbols: M rows of x, K in-features, N out-features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels.autograd import records_grad
from dspark.kernels.registry import require_triton
from dspark.kernels.rope import launch_rope, rotate_pairs
from dspark.kernels.rope_ref import rope_ref

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prefetch, pdl_prologue, prefetch_launch

# One H200, CUDA-graph replays (`bench/linear_decode.py`): the kernel won for every weight with
# K >= 2048 and at most 4M elements (v4-mini wq_a / wkv / wo_b / weights_proj / compressor wkv:
# 1.11-2.98×; V4-Flash wq_a / wkv: 1.38-1.51×) and lost for every other (K = 512 or 1024 rows:
# 0.76-0.86×; 8M+ elements incl. the LM heads: 0.77-0.89×).
GEMV_MIN_K = 2048
GEMV_MAX_ELEMENTS = 4 << 20
# One-row calls on rows of 512 (v4-mini's and v41-mini's `wq_b` [16384, 512] and indexer `wq_b` [8192, 512])
# run the GEMV too, though cuBLAS won them timed alone (0.76-0.86x above): inside the graph step, behind
# PDL and the weight prefetch, the step was 1.008-1.011x faster with them on the GEMV (one H100, v4-mini
# batch 1, five runs; v41-mini 0.999-1.008x; graphs timed in turn, `bench/graph_decode.py --gemv-ab`,
# bench/results/*-s38.json). Up to 4 rows it lost (0.95-0.97x): one row only. K = 1024 (V4-Flash) was
# not timed in a step: it stays on cuBLAS.
SHORT_K = 512
SHORT_K_MAX_ELEMENTS = 8 << 20
SHORT_K_MAX_ROWS = 1
# The widest K tile of the GEMVs (`gemv_tiles`). 2048 is a candidate, not yet timed: rows of 2048 (v4-mini's
# wq_a, wkv, wo_b, weights_proj and compressor projections; `grouped_wo_a`'s GEMV in two steps of its 4096)
# would load in one K step instead of two, at every row count, with 8 warps. Its one-row-only form was
# 1.009-1.011x in the v4-mini and v41-mini graph steps (one H100, forty-fifth session, `one-k-tile-*-s45-*.json`)
# but broke the rows' bit equality with one-row launches; `bench/graph_decode.py --gemv-ab k_tile_2048` times this
# form (`bench/gpu_session50.sh b`).
GEMV_K_TILE = 1024
# Whether `linear_rope` rotates in the GEMV's epilogue (one launch) where the GEMV runs: the indexers' queries at
# one decode row (K = 512: `SHORT_K`), on a CSA layer's KV lane between c_q and the selection. A candidate, not yet
# timed (`bench/graph_decode.py --gemv-ab rope_epilogue`); the same bits as the two launches (`_rope_pairs`).
ROPE_EPILOGUE = False
# The most rows the kernels take (ROWS, a power of two: every weight tile multiplies ROWS rows of x
# on the CUDA cores; from 16 rows a tensor-core tile is the tool).
MAX_ROWS = 8
# The most rows `linear` sends to `_gemv_kernel`. On the H200 (`bench/linear_decode.py --rows 1,2,4,8`,
# `bench/results/linear-rows-h200.json`) the weights the K and size rule picks ran 1.05-2.06× cuBLAS at
# 2 and 4 rows (v4-mini wq_a / wkv / wo_b / weights_proj / compressor wkv, V4-Flash wq_a / wkv), and at
# 8 rows wo_b fell to 0.66×, the compressor wkv to 0.90×, V4-Flash wq_a to 0.82×.
GEMV_MAX_ROWS = 4
# The most rows `compressor_project` sends to `_project_kernel`: every row count the kernel takes. Its
# reference is six launches (2 matmuls, a gather, an add, 2 ring copies: 17-34 µs on the H200 at one
# row, the kernel 4.3-7.2 µs), and at <= 8 rows the kernel still streams each weight once.
PROJECT_MAX_ROWS = MAX_ROWS


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


def linear_scaled_ref(x: torch.Tensor, weight: torch.Tensor, *, scale: float) -> torch.Tensor:
    """fp32(x · weightᵀ in x.dtype) · scale -> [..., N] fp32 (the models' former code)."""
    _check_args(x, weight)
    return F.linear(x, weight).float() * scale


def _check_rope_args(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    _check_args(x, weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [N, K], got shape {tuple(x.shape)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or weight.shape[0] % head_dim:
        raise ValueError(f"head_dim must be a positive int dividing weight's {weight.shape[0]} rows, got {head_dim!r}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[0] or not 0 < 2 * cos.shape[1] <= head_dim:
        raise ValueError(f"cos / sin must both be [N, rd/2] with N = {x.shape[0]} and 0 < rd <= head_dim = {head_dim}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")


def linear_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                    head_dim: int) -> torch.Tensor:
    """rope(x·weightᵀ as [N, H, d], cos, sin) -> [N, H, d] in x.dtype (the models' former code)."""
    _check_rope_args(x, weight, cos, sin, head_dim)
    return rope_ref(F.linear(x, weight).unflatten(-1, (-1, head_dim)), cos.unsqueeze(-2), sin.unsqueeze(-2))


def _check_pair_args(x, wkv, wgate) -> None:
    """x [N, K] and two weights [W, K] of x's dtype (both projection ops)."""
    _check_args(x, wkv)
    if wgate.shape != wkv.shape or wgate.dtype != wkv.dtype:
        raise ValueError(f"wgate must match wkv {tuple(wkv.shape)} {wkv.dtype}, got {tuple(wgate.shape)} {wgate.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [N, K], got shape {tuple(x.shape)}")


def _check_project_args(x, wkv, wgate, ape, phase) -> None:
    _check_pair_args(x, wkv, wgate)
    if ape.dim() != 2 or ape.shape[1] != wkv.shape[0] or ape.dtype != torch.float32:
        raise ValueError(f"ape must be fp32 [rate, {wkv.shape[0]}], got {tuple(ape.shape)} {ape.dtype}")
    if phase.shape != (x.shape[0],) or phase.dtype != torch.long:
        raise ValueError(f"phase must be long [{x.shape[0]}], got {tuple(phase.shape)} {phase.dtype}")


def _check_dest(x, wkv, outs: dict, out_rows) -> None:
    """The destinations of a projection pair: `outs` {name: (tensor or None, dtype)} and out_rows,
    all given or none; each output [R, W] of its dtype with contiguous rows, out_rows long [N]."""
    given = [t is not None for t, _ in outs.values()] + [out_rows is not None]
    if any(given) and not all(given):
        raise ValueError(f"{', '.join(outs)} and out_rows go together: pass all three or none")
    if not all(given):
        return
    width = wkv.shape[0]
    for name, (out, dtype) in outs.items():
        if out.dim() != 2 or out.shape[1] != width or out.dtype != dtype or out.stride(1) != 1:
            raise ValueError(f"{name} must be [R, {width}] {dtype} with contiguous rows, got {tuple(out.shape)} "
                             f"{out.dtype}")
    if out_rows.shape != (x.shape[0],) or out_rows.dtype != torch.long:
        raise ValueError(f"out_rows must be long [{x.shape[0]}], got {tuple(out_rows.shape)} {out_rows.dtype}")


def _check_project_dest(x, wkv, kv_out, score_out, out_rows) -> None:
    _check_dest(x, wkv, {"kv_out": (kv_out, x.dtype), "score_out": (score_out, torch.float32)}, out_rows)


def compressor_project_ref(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
                           phase: torch.Tensor, *, kv_out: torch.Tensor | None = None,
                           score_out: torch.Tensor | None = None,
                           out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x·wkvᵀ [N, W] x.dtype, x·wgateᵀ + ape[phase] [N, W] fp32); model dtype + fp32 promotes to fp32.
    With kv_out / score_out / out_rows both are copied to rows out_rows; returns (kv_out, score_out)."""
    _check_project_args(x, wkv, wgate, ape, phase)
    _check_project_dest(x, wkv, kv_out, score_out, out_rows)
    kv, score = F.linear(x, wkv), F.linear(x, wgate) + ape[phase]
    if kv_out is None:
        return kv, score
    return kv_out.index_copy_(0, out_rows, kv), score_out.index_copy_(0, out_rows, score)


def _check_pair_dest(x, wkv, kv_out, gate_out, out_rows) -> None:
    _check_dest(x, wkv, {"kv_out": (kv_out, torch.float32), "gate_out": (gate_out, torch.float32)}, out_rows)


def compressor_project_fp32_ref(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, *,
                                kv_out: torch.Tensor | None = None, gate_out: torch.Tensor | None = None,
                                out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x·wkvᵀ, x·wgateᵀ) [N, W] fp32 from x and weights promoted to fp32; with kv_out / gate_out /
    out_rows both are copied to rows out_rows and (kv_out, gate_out) returned."""
    _check_pair_args(x, wkv, wgate)
    _check_pair_dest(x, wkv, kv_out, gate_out, out_rows)
    x32 = x.float()
    kv, gate = F.linear(x32, wkv.float()), F.linear(x32, wgate.float())
    if kv_out is None:
        return kv, gate
    return kv_out.index_copy_(0, out_rows, kv), gate_out.index_copy_(0, out_rows, gate)


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _rows_times_tile(acc, x, w_ptr, rows, offs_k, mask):
    """acc [ROWS, BLOCK_N, BLOCK_K] + w·x for one K tile: w [1, BLOCK_N, BLOCK_K] loaded at the weight
    rows `rows` [1, BLOCK_N, 1] (element offsets) and columns offs_k [1, 1, BLOCK_K], x [ROWS, 1, BLOCK_K]
    fp32. Each (row, n, k) lane of acc adds its own product, so a row's lanes hold the same partial
    sums at every ROWS."""
    w = tl.load(w_ptr + rows + offs_k, mask=mask, other=0.0).to(tl.float32)
    return acc + w * x  # one reduction after the loop, not one per tile


@_jit
def _x_tile(x_ptr, offs_m, m_mask, n_in, offs_k, k_mask):
    """Rows offs_m of x [M, K] (contiguous), columns offs_k, fp32 [ROWS, 1, BLOCK_K]; masked lanes 0."""
    ptrs = x_ptr + offs_m.to(tl.int64)[:, None, None] * n_in + offs_k[None, None, :]
    return tl.load(ptrs, mask=m_mask[:, None, None] & k_mask[None, None, :], other=0.0).to(tl.float32)


@_jit
def _rope_pairs(y, cos_ptr, sin_ptr, offs_m, m_mask, head_dim, half, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """y [ROWS, BLOCK_N] (program n's columns, rounded to the output dtype, fp32) with each head's trailing
    2·half columns rotated pairwise by row m's cos / sin [M, half] (fp32, contiguous) as the `rope` op does
    (`rope.rotate_pairs`). BLOCK_N is even and a program's first column is too, so a pair (even, odd column)
    never straddles programs."""
    col = tl.program_id(0) * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)  # each pair's even column
    j = col % head_dim - (head_dim - 2 * half)  # index inside the head's rotary dims, < 0 for "nope" columns
    rot = j >= 0
    cs = offs_m.to(tl.int64)[:, None] * half + (tl.maximum(j, 0) // 2)[None, :]
    mask = m_mask[:, None] & rot[None, :]
    return rotate_pairs(y, tl.load(cos_ptr + cs, mask=mask, other=1.0), tl.load(sin_ptr + cs, mask=mask, other=0.0),
                        rot)


@_jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_out, n_in, scale, cos_ptr, sin_ptr, head_dim, half,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                 ROPE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = Σ_k x[m, k]·w[n, k] for the n_rows (<= ROWS) rows of x and the BLOCK_N weight rows of
    program n, fp32 sums: each weight tile is read once and multiplied with every row of x. SCALED:
    the sum rounded to x's dtype, then times `scale` in fp32 (y fp32). ROPE: the sum rounded to x's
    dtype, then each head's rotary columns rotated (`_rope_pairs`; cos_ptr, sin_ptr, head_dim, half).
    With PREFETCH the program's weight rows are requested into L2 before it waits for its predecessor."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    if PREFETCH:
        first = tl.program_id(0) * BLOCK_N
        rows_here = tl.minimum(BLOCK_N, n_out - first)
        pdl_prefetch(w_ptr + first.to(tl.int64) * n_in, rows_here * n_in * (w_ptr.dtype.element_ty.primitive_bitwidth // 8),
                     PDL)
    pdl_prologue(PDL)
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < n_rows
    rows = offs_n.to(tl.int64)[None, :, None] * n_in
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < n_in
        x = _x_tile(x_ptr, offs_m, m_mask, n_in, offs_k, k_mask)
        acc = _rows_times_tile(acc, x, w_ptr, rows, offs_k[None, None, :], n_mask[None, :, None] & k_mask[None, None, :])
    y = tl.sum(acc, axis=2)
    if SCALED:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32) * scale
    if ROPE:
        y = _rope_pairs(y.to(x_ptr.dtype.element_ty).to(tl.float32), cos_ptr, sin_ptr, offs_m, m_mask, head_dim, half,
                        ROWS, BLOCK_N)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * n_out + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@_jit
def _project_kernel(x_ptr, wkv_ptr, wgate_ptr, ape_ptr, phase_ptr, rows_ptr, kv_ptr, score_ptr, n_rows, n_out, n_in,
                    kv_stride, score_stride, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SCATTER: tl.constexpr, APE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """kv[r, n] = Σ_k x[m, k]·wkv[n, k] and score[r, n] = round(Σ_k x[m, k]·wgate[n, k]) + ape[phase[m], n]
    for the n_rows (<= ROWS) rows m of x and the BLOCK_N columns of program n (x read once for both
    weights, each weight tile once for every row), fp32 sums; r = rows[m] with SCATTER (the row's place
    in a ring), else m. Without APE (V4.1) score is the fp32 sum itself. kv is stored in kv's dtype.
    PREFETCH: as `_gemv_kernel`'s, for both weights."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    if PREFETCH:
        first = tl.program_id(0) * BLOCK_N
        tile_bytes = tl.minimum(BLOCK_N, n_out - first) * n_in * (wkv_ptr.dtype.element_ty.primitive_bitwidth // 8)
        pdl_prefetch(wkv_ptr + first.to(tl.int64) * n_in, tile_bytes, PDL)
        pdl_prefetch(wgate_ptr + first.to(tl.int64) * n_in, tile_bytes, PDL)
    pdl_prologue(PDL)
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < n_rows
    rows = offs_n.to(tl.int64)[None, :, None] * n_in
    acc_kv = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_gate = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < n_in
        mask = n_mask[None, :, None] & k_mask[None, None, :]
        x = _x_tile(x_ptr, offs_m, m_mask, n_in, offs_k, k_mask)
        acc_kv = _rows_times_tile(acc_kv, x, wkv_ptr, rows, offs_k[None, None, :], mask)
        acc_gate = _rows_times_tile(acc_gate, x, wgate_ptr, rows, offs_k[None, None, :], mask)
    if SCATTER:
        out_row = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        out_row = offs_m.to(tl.int64)
    mask = m_mask[:, None] & n_mask[None, :]
    kv = tl.sum(acc_kv, axis=2).to(kv_ptr.dtype.element_ty)
    tl.store(kv_ptr + out_row[:, None] * kv_stride + offs_n[None, :], kv, mask=mask)
    gate = tl.sum(acc_gate, axis=2)
    if APE:
        gate = gate.to(x_ptr.dtype.element_ty).to(tl.float32)  # the linear's rounding
        phase = tl.load(phase_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        gate += tl.load(ape_ptr + phase[:, None] * n_out + offs_n[None, :], mask=mask, other=0.0)
    tl.store(score_ptr + out_row[:, None] * score_stride + offs_n[None, :], gate, mask=mask)


# ------------------------------------------------------------------------------------- launchers


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # Triton interpreter on CPU: few programs keep it fast


def gemv_tiles(n_out: int, n_in: int, n_sms: int, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of `_gemv_kernel` for `rows` rows of x. The grid: 1024-wide K tiles,
    8192-element accumulators in all (ROWS·BLOCK_N·BLOCK_K, ROWS = rows rounded up to a power of two:
    16 KB of bf16 weights in flight per program and step at one row), and BLOCK_N small enough that
    the grid has about two programs per SM when N allows. With GEMV_K_TILE above 1024, longer rows then
    take tiles that wide on that grid (BLOCK_N shrunk to match, at least 1) and 8 warps: all of a row of
    2048 in one round trip. BLOCK_K depends on K alone, and the warps on the weight tile (K tiles up to
    1024) or on K alone (wider), so every row count accumulates a row over the same lanes (see
    `launch_gemv`)."""
    block_k = min(1024, max(16, triton.next_power_of_2(n_in)))
    block_n = max(1, 8192 // (block_k * triton.next_power_of_2(rows)))
    while block_n > 1 and triton.cdiv(n_out, block_n) < 2 * n_sms:
        block_n //= 2
    wide = min(GEMV_K_TILE, triton.next_power_of_2(n_in))
    if wide > block_k:  # 8 warps: 32 lanes × 8 k each × 8 warps span a 2048-wide tile along K
        return max(1, block_n * block_k // wide), wide, 8
    return block_n, block_k, 8 if block_n * block_k >= 8192 else 4


def gemv_pays(rows: int, n_out: int, n_in: int) -> bool:
    """Whether `linear` runs `_gemv_kernel` for this call (see GEMV_MIN_K, GEMV_MAX_ROWS, SHORT_K)."""
    if n_in == SHORT_K:
        return 1 <= rows <= SHORT_K_MAX_ROWS and n_out * n_in <= SHORT_K_MAX_ELEMENTS
    return 1 <= rows <= GEMV_MAX_ROWS and n_in >= GEMV_MIN_K and n_out * n_in <= GEMV_MAX_ELEMENTS


def _check_rows(rows: int, launcher: str) -> None:
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{launcher} takes 1 to {MAX_ROWS} rows, got {rows}")


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int] | None = None, *,
                scale: float | None = None, rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """`_gemv_kernel` for the M = x.numel() / K rows of x [..., K] (1 <= M <= MAX_ROWS) whatever the
    weight; `tiles` overrides `gemv_tiles` (the bench compares it with torch on every shape; the model
    goes through `linear`). At the default tiles each row's result is bit-identical to a one-row launch
    on that row (on the H200 not for fp32 with a masked K tail, K = 1500: ulps apart, FMA contraction): BLOCK_K depends on K alone and the accumulator takes the weight tile's layout (8
    consecutive k per thread, 32 lanes and BLOCK_K / 256 warps along K, the other warps along N), so
    every row count sums a row's products in the same lanes, the same K-tile order and the same
    reduction tree. With `scale`: `linear_scaled`'s fp32 output from the same sums. With `rope` = (cos,
    sin, head_dim) (x [M, K], cos / sin [M, rd/2]): `linear_rope`'s rotated rows from the same sums (tiles
    with an even BLOCK_N, `rope_tiles`)."""
    _check_args(x, weight)
    n_out, n_in = weight.shape
    rows = x.numel() // max(1, n_in)
    _check_rows(rows, "launch_gemv")
    require_triton()
    if scale is not None and rope is not None:
        raise ValueError("launch_gemv takes a scale or a rope, not both")
    y = torch.empty(rows, n_out, dtype=x.dtype if scale is None else torch.float32, device=x.device)
    block_n, block_k, warps = tiles or gemv_tiles(n_out, n_in, _num_sms(x.device), rows)
    cos, sin, head_dim = rope if rope is not None else (y, y, 2)  # unread without ROPE
    if rope is not None:
        _check_rope_args(x.reshape(rows, n_in), weight, cos, sin, head_dim)
        if not rope_tiles(block_n, head_dim):
            raise ValueError(f"launch_gemv's rope needs an even BLOCK_N and an even head_dim, got BLOCK_N {block_n}, "
                             f"head_dim {head_dim}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    grid = (triton.cdiv(n_out, block_n),)
    pdl = pdl_launch(x.device, grid[0])
    weight = weight.contiguous()
    _gemv_kernel[grid](x.contiguous(), weight, y, rows, n_out, n_in, 1.0 if scale is None else float(scale),
                       cos, sin, head_dim, cos.shape[-1] if rope is not None else 1,
                       ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, SCALED=scale is not None,
                       ROPE=rope is not None, PREFETCH=prefetch_launch(pdl, weight), PDL=pdl, launch_pdl=pdl,
                       num_warps=warps)
    return y.reshape(*x.shape[:-1], n_out)


def rope_tiles(block_n: int, head_dim: int) -> bool:
    """Whether `_gemv_kernel` can rotate in its epilogue at this BLOCK_N: whole pairs per program (BLOCK_N
    even, and every pair starting on an even column: head_dim even, so its unrotated columns too, the rotary
    ones being an even 2·half)."""
    return block_n >= 2 and block_n % 2 == 0 and head_dim % 2 == 0


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Fused `linear_ref` (same signature): `_gemv_kernel` where `gemv_pays`, torch's matmul elsewhere
    and while autograd records (the kernel has no backward)."""
    _check_args(x, weight)
    n_out, n_in = weight.shape
    if not gemv_pays(x.numel() // max(1, n_in), n_out, n_in) or records_grad(x, weight):
        return F.linear(x, weight)
    return launch_gemv(x, weight)


def linear_scaled(x: torch.Tensor, weight: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Fused `linear_scaled_ref` (same signature): `_gemv_kernel`'s sums rounded and scaled in its
    epilogue where `gemv_pays` (the same sums `linear` rounds there), the reference elsewhere."""
    _check_args(x, weight)
    n_out, n_in = weight.shape
    if not gemv_pays(x.numel() // max(1, n_in), n_out, n_in) or records_grad(x, weight):
        return linear_scaled_ref(x, weight, scale=scale)
    return launch_gemv(x, weight, scale=scale)


def linear_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                head_dim: int) -> torch.Tensor:
    """Fused `linear_rope_ref` (same signature): with ROPE_EPILOGUE, one `_gemv_kernel` launch that rotates in
    its epilogue where `gemv_pays` (and `rope_tiles` holds); otherwise `linear` then the `rope` kernel (the
    reference while autograd records)."""
    _check_rope_args(x, weight, cos, sin, head_dim)
    n_out, n_in = weight.shape
    if records_grad(x, weight, cos, sin):
        return linear_rope_ref(x, weight, cos, sin, head_dim=head_dim)
    rows = x.shape[0]
    tiles = gemv_tiles(n_out, n_in, _num_sms(x.device), rows)
    if ROPE_EPILOGUE and gemv_pays(rows, n_out, n_in) and rope_tiles(tiles[0], head_dim):
        return launch_gemv(x, weight, tiles, rope=(cos, sin, head_dim)).unflatten(-1, (-1, head_dim))
    return launch_rope(linear(x, weight).unflatten(-1, (-1, head_dim)), cos.unsqueeze(-2), sin.unsqueeze(-2))


def project_tiles(n_out: int, n_in: int, n_sms: int, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of `_project_kernel` for `rows` rows: the GEMV's tiles for the 2W rows
    of both weights, BLOCK_N halved for its two [ROWS, BLOCK_N, BLOCK_K] accumulators."""
    block_n, block_k, warps = gemv_tiles(2 * n_out, n_in, n_sms, rows)
    return max(1, block_n // 2), block_k, warps


def project_pays(rows: int, width: int, n_in: int) -> bool:
    """Whether `compressor_project` runs `_project_kernel`: 1 to PROJECT_MAX_ROWS rows of K >= GEMV_MIN_K
    and both weights together ([2W, K]) of at most GEMV_MAX_ELEMENTS (see PROJECT_MAX_ROWS)."""
    return 1 <= rows <= PROJECT_MAX_ROWS and n_in >= GEMV_MIN_K and 2 * width * n_in <= GEMV_MAX_ELEMENTS


def launch_project(x, wkv, wgate, ape, phase, tiles: tuple[int, int, int] | None = None, *, kv_out=None,
                   score_out=None, out_rows=None):
    """`_project_kernel` for the 1 to MAX_ROWS rows of x [M, K] whatever the weights (the bench compares
    it with the reference on every shape; the model goes through `compressor_project`); with the
    destinations of `compressor_project` it stores row i at out_rows[i] of kv_out / score_out and
    returns them. Rows are bit-identical to one-row launches at the default tiles (as `launch_gemv`, with
    its fp32 exception)."""
    _check_project_args(x, wkv, wgate, ape, phase)
    _check_project_dest(x, wkv, kv_out, score_out, out_rows)
    return _launch_project(x, wkv, wgate, (ape, phase), kv_out, score_out, out_rows, x.dtype, tiles)


def launch_project_fp32(x, wkv, wgate, tiles: tuple[int, int, int] | None = None, *, kv_out=None, gate_out=None,
                        out_rows=None):
    """`_project_kernel` without the position bias for `compressor_project_fp32` (as `launch_project`)."""
    _check_pair_args(x, wkv, wgate)
    _check_pair_dest(x, wkv, kv_out, gate_out, out_rows)
    return _launch_project(x, wkv, wgate, None, kv_out, gate_out, out_rows, torch.float32, tiles)


def _launch_project(x, wkv, wgate, ape_phase, kv_out, score_out, out_rows, kv_dtype, tiles):
    """One `_project_kernel` launch (arguments checked by the caller); ape_phase None: V4.1's fp32 pair."""
    rows = x.shape[0]
    _check_rows(rows, "launch_project")
    require_triton()
    n_out, n_in = wkv.shape
    scatter = out_rows is not None
    if not scatter:
        kv_out = torch.empty((rows, n_out), dtype=kv_dtype, device=x.device)
        score_out = torch.empty((rows, n_out), dtype=torch.float32, device=x.device)
    block_n, block_k, warps = tiles or project_tiles(n_out, n_in, _num_sms(x.device), rows)
    grid = (triton.cdiv(n_out, block_n),)
    pdl = pdl_launch(x.device, grid[0])
    wkv, wgate = wkv.contiguous(), wgate.contiguous()
    ape, phase = (t.contiguous() for t in ape_phase) if ape_phase is not None else (score_out, score_out)  # dummies
    _project_kernel[grid](
        x.contiguous(), wkv, wgate, ape, phase, out_rows.contiguous() if scatter else phase, kv_out, score_out, rows,
        n_out, n_in, kv_out.stride(0), score_out.stride(0), ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n,
        BLOCK_K=block_k, SCATTER=scatter, APE=ape_phase is not None, PREFETCH=prefetch_launch(pdl, wkv, wgate),
        PDL=pdl, launch_pdl=pdl, num_warps=warps)
    return kv_out, score_out


def compressor_project(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
                       phase: torch.Tensor, *, kv_out: torch.Tensor | None = None,
                       score_out: torch.Tensor | None = None,
                       out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `compressor_project_ref` (same signature): `_project_kernel` where `project_pays` (storing
    at out_rows itself), the reference elsewhere (which copies to out_rows after it) and while
    autograd records."""
    _check_project_args(x, wkv, wgate, ape, phase)
    dest = dict(kv_out=kv_out, score_out=score_out, out_rows=out_rows)
    n_out, n_in = wkv.shape
    if not project_pays(x.shape[0], n_out, n_in) or records_grad(x, wkv, wgate, ape):
        return compressor_project_ref(x, wkv, wgate, ape, phase, **dest)
    return launch_project(x, wkv, wgate, ape, phase, **dest)


def compressor_project_fp32(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, *,
                            kv_out: torch.Tensor | None = None, gate_out: torch.Tensor | None = None,
                            out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `compressor_project_fp32_ref` (same signature): `_project_kernel` without the position bias
    where `project_pays` (no fp32 weight copies; the rows stored at out_rows by the kernel), the
    reference elsewhere and while autograd records."""
    _check_pair_args(x, wkv, wgate)
    dest = dict(kv_out=kv_out, gate_out=gate_out, out_rows=out_rows)
    n_out, n_in = wkv.shape
    if not project_pays(x.shape[0], n_out, n_in) or records_grad(x, wkv, wgate):
        return compressor_project_fp32_ref(x, wkv, wgate, **dest)
    return launch_project_fp32(x, wkv, wgate, **dest)
