"""DeepSeek-V4 MoE block (spec §11): router, grouped expert GEMMs with clamped SwiGLU, finalize.

Ops (each `<op>` is Triton, `<op>_ref` is torch, same signature):

* ``moe_route(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k, routed_scaling_factor,
  hash_routing) -> (weights [N, K] fp32, ids [N, K] int32)`` (§11.1)
* ``fused_moe(x, gate_weight, gate_bias, tid2eid, token_ids, w1, w2, w3, shared_w1, shared_w2,
  shared_w3, *, top_k, routed_scaling_factor, swiglu_limit, hash_routing) -> y [N, D] x.dtype``

Shape symbols: N tokens, D hidden, E routed experts, K = top_k, I expert width (I_s for the shared
expert), V vocabulary, R rows of the packed per-expert list, B quantisation block.

Fused pipeline (no host sync; CUDA-graph capturable):

1. router kernel: logits = x·W_gᵀ in fp32, s = sqrt(softplus(logits)), top-k of s + bias by K
   rounds of argmax (or ids = tid2eid[token_ids] for hash layers), weights = s[ids] renormalised
   × routed_scaling_factor (up to ROUTE_DECODE_MAX_TOKENS tokens the logits GEMM is split over the
   GPU instead, and a second kernel runs the same epilogue: `moe_route_decode`);
2. packing: the N·K (token, slot) assignments grouped by expert, each group padded to a multiple
   of BLOCK_M, in a buffer sized by the static bound N·K + min(N·K, E)·(BLOCK_M − 1), so that each
   M-block holds one expert; unused blocks are skipped by the kernels. Up to
   PACK_KERNEL_MAX_ASSIGNMENTS assignments one kernel (`_pack_kernel`), above a torch stable sort;
3. grouped GEMM 1 per M-block: g = x·W1ᵀ, u = x·W3ᵀ and the clamped SwiGLU h = silu(min(g, L)) ·
   clamp(u, −L, L) in its epilogue (h never exists un-activated in memory); the shared expert runs
   through the same kernel with the identity row map;
4. grouped GEMM 2: h·W2ᵀ per row (fp32 rows);
5. finalize: y = shared + Σ_k weight_k · row(token, k), one pass, cast to x.dtype.

Weights are bf16/fp32 tensors or `FP8BlockWeight` (e4m3 + UE8M0 block scales, 128×128 for V4
§13.3, 32×32 for V4.1 §11): the kernels dequantise each [BLOCK_N, BLOCK_K] weight tile in registers
(one scale per row when BLOCK_K divides B, else one per B columns of the row); activations stay in
x.dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark.kernels.fp8 import FP8BlockWeight
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


_RENORM_EPS = 1e-20  # added to Σ of the selected scores before renormalising (HF; OFF adds none)


def _dense(weight, index: int | None = None) -> torch.Tensor:
    """fp32 copy of a tensor or FP8BlockWeight (of one expert when `index` is given)."""
    if isinstance(weight, FP8BlockWeight):
        return weight.dequantize(index)
    return (weight if index is None else weight[index]).float()


# ---------------------------------------------------------------------------------------- checks


def _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing, bias_rows=False) -> None:
    """`moe_route`'s operands (with `bias_rows`, `moe_route_rows`': gate_bias [N, E], one row per token)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    n_tok, dim = x.shape
    if gate_weight.dim() != 2 or gate_weight.shape[1] != dim:
        raise ValueError(f"gate_weight must be [E, D={dim}], got {tuple(gate_weight.shape)}")
    n_exp = gate_weight.shape[0]
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k must be in [1, E={n_exp}], got {top_k}")
    if hash_routing:
        if tid2eid is None or tid2eid.dim() != 2 or tid2eid.shape[1] != top_k:
            raise ValueError(f"tid2eid must be [V, top_k={top_k}] for hash routing, got "
                             f"{None if tid2eid is None else tuple(tid2eid.shape)}")
        if token_ids is None or tuple(token_ids.shape) != (n_tok,):
            raise ValueError(f"token_ids must be [N={n_tok}] for hash routing, got "
                             f"{None if token_ids is None else tuple(token_ids.shape)}")
    elif gate_bias is None or tuple(gate_bias.shape) != ((n_tok, n_exp) if bias_rows else (n_exp,)):
        want = f"[N={n_tok}, E={n_exp}]" if bias_rows else f"[E={n_exp}]"
        raise ValueError(f"gate_bias must be {want} for score routing, got "
                         f"{None if gate_bias is None else tuple(gate_bias.shape)}")
    if bias_rows and hash_routing:
        raise ValueError("moe_route_rows takes score routing only (hash_routing=False)")


def _check_expert_args(x, n_exp, w1, w2, w3, shared_w1, shared_w2, shared_w3) -> None:
    dim = x.shape[1]
    if len(w1.shape) != 3 or w1.shape[0] != n_exp or w1.shape[2] != dim:
        raise ValueError(f"w1 must be [E={n_exp}, I, D={dim}], got {tuple(w1.shape)}")
    inter = w1.shape[1]
    if tuple(w3.shape) != tuple(w1.shape):
        raise ValueError(f"w3 must be [E, I, D] = {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if tuple(w2.shape) != (n_exp, dim, inter):
        raise ValueError(f"w2 must be [E, D, I] = {(n_exp, dim, inter)}, got {tuple(w2.shape)}")
    if len(shared_w1.shape) != 2 or shared_w1.shape[1] != dim:
        raise ValueError(f"shared_w1 must be [I_s, D={dim}], got {tuple(shared_w1.shape)}")
    if tuple(shared_w3.shape) != tuple(shared_w1.shape):
        raise ValueError(f"shared_w3 must be [I_s, D] = {tuple(shared_w1.shape)}, got {tuple(shared_w3.shape)}")
    if tuple(shared_w2.shape) != (dim, shared_w1.shape[0]):
        raise ValueError(f"shared_w2 must be [D, I_s] = {(dim, shared_w1.shape[0])}, got {tuple(shared_w2.shape)}")
    for name, a, b in (("w1/w3", w1, w3), ("shared_w1/shared_w3", shared_w1, shared_w3)):
        if isinstance(a, FP8BlockWeight) != isinstance(b, FP8BlockWeight) or \
                (isinstance(a, FP8BlockWeight) and a.block != b.block):
            raise ValueError(f"{name} must share one format (both dense or both FP8 with one block)")


# ------------------------------------------------------------------------------------ references


def moe_route_ref(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int,
                  routed_scaling_factor: float, hash_routing: bool, bias_rows: bool = False):
    """Router of spec §11.1.

    Shape: x [N, D]; gate_weight [E, D]; gate_bias [E] fp32 (score routing; None for hash layers;
    [N, E], one row per token, with `bias_rows`); tid2eid [V, K] int and token_ids [N] int (hash
    routing; may be None otherwise).
    Returns weights [N, K] fp32 (un-biased scores at the picks, renormalised, × scaling) and
    ids [N, K] int32 (score routing: descending s + bias).
    """
    _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing, bias_rows)
    scores = torch.sqrt(F.softplus(x.float() @ gate_weight.float().T))  # [N, E], fp32 as OFF
    if hash_routing:
        ids = tid2eid[token_ids.long()].long()  # [N, K]
    else:
        ids = torch.topk(scores + gate_bias.float(), top_k, dim=-1).indices  # bias: selection only
    picked = scores.gather(1, ids)
    weights = picked / (picked.sum(dim=-1, keepdim=True) + _RENORM_EPS) * routed_scaling_factor
    return weights, ids.to(torch.int32)


def _expert_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float):
    """Clamped SwiGLU expert (§11.2), fp32: [T, D] -> [T, D]."""
    gate, up = x @ w1.T, x @ w3.T
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up) @ w2.T


def _check_routing_args(x, weights, ids, n_exp) -> None:
    n_tok = x.shape[0]
    if weights.dim() != 2 or weights.shape[0] != n_tok:
        raise ValueError(f"weights must be [N={n_tok}, K], got {tuple(weights.shape)}")
    if tuple(ids.shape) != tuple(weights.shape):
        raise ValueError(f"ids must be [N, K] = {tuple(weights.shape)}, got {tuple(ids.shape)}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if weights.shape[1] > n_exp:
        raise ValueError(f"K={weights.shape[1]} routing slots exceed E={n_exp} experts")


def moe_experts_ref(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *,
                    swiglu_limit: float, x_ready: bool = False, counters=None) -> torch.Tensor:
    """y = Σ_k weights_k · Expert_{ids_k}(x) + Shared(x) for a routing computed elsewhere (spec §11.2).

    Shape: x [N, D] bf16/fp32; weights [N, K] fp32 (final routing weights, scaling included);
    ids [N, K] int in [0, E); w1, w3 [E, I, D]; w2 [E, D, I]; shared_w1, shared_w3 [I_s, D];
    shared_w2 [D, I_s] (tensors or `FP8BlockWeight`). Returns y [N, D] in x.dtype; fp32 math,
    loop over experts (a host sync per expert: fine in a reference). `x_ready`: a promise about launch
    order that the fused op may use (`moe_experts`), as it may `counters` (`experts_counters`); neither
    changes the result, and the reference ignores both.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    n_exp = w1.shape[0]
    _check_routing_args(x, weights, ids, n_exp)
    _check_expert_args(x, n_exp, w1, w2, w3, shared_w1, shared_w2, shared_w3)
    xf = x.float()
    y = _expert_ref(xf, _dense(shared_w1), _dense(shared_w2), _dense(shared_w3), swiglu_limit)
    for e in range(n_exp):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        out = _expert_ref(xf[tok], _dense(w1, e), _dense(w2, e), _dense(w3, e), swiglu_limit)
        y.index_add_(0, tok, weights[tok, slot, None].float() * out)
    return y.to(x.dtype)


def fused_moe_ref(x, gate_weight, gate_bias, tid2eid, token_ids, w1, w2, w3, shared_w1, shared_w2,
                  shared_w3, *, top_k: int, routed_scaling_factor: float, swiglu_limit: float,
                  hash_routing: bool) -> torch.Tensor:
    """MoE(x) = Σ_k g_k · Expert_{ids_k}(x) + Shared(x) (spec §11): `moe_route_ref`, then
    `moe_experts_ref`.

    Shape: x [N, D] bf16/fp32; router args as in `moe_route_ref`; w1, w3 [E, I, D]; w2 [E, D, I];
    shared_w1, shared_w3 [I_s, D]; shared_w2 [D, I_s]; weights are tensors or `FP8BlockWeight`.
    Returns y [N, D] in x.dtype.
    """
    _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing)
    _check_expert_args(x, gate_weight.shape[0], w1, w2, w3, shared_w1, shared_w2, shared_w3)
    weights, ids = moe_route_ref(x, gate_weight, gate_bias, tid2eid, token_ids, top_k=top_k,
                                 routed_scaling_factor=routed_scaling_factor, hash_routing=hash_routing)
    return moe_experts_ref(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3,
                           swiglu_limit=swiglu_limit)


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _sqrt_softplus(logits):
    """sqrt(ln(1 + e^l)) without overflow; log1p(z) = z·ln(1+z)/((1+z)−1) keeps small z exact."""
    z = tl.exp(-tl.abs(logits))
    w = 1.0 + z
    log1p = tl.where(w == 1.0, z, tl.log(w) * z / tl.where(w == 1.0, 1.0, w - 1.0))  # no 0/0 lanes
    return tl.sqrt(tl.maximum(logits, 0.0) + log1p)


@_jit
def _route_pick(logits, offs_t, t_mask, offs_e, e_mask, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr,
                scaling, n_exp, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                HASH: tl.constexpr, BIAS_ROWS: tl.constexpr):
    """The router's epilogue for fp32 logits [BLOCK_T, E_PAD] of tokens offs_t (shared by the prefill
    kernel and `moe_route_decode`): scores, the K picks and their renormalised, scaled weights, stored.
    Taken and padded experts are masked with -3e38, not -inf: finite, and below any real score.
    BIAS_ROWS: the selection bias is one row per token ([N, E], `moe_route_rows`), else one [E] row."""
    scores = _sqrt_softplus(logits)
    if HASH:
        tok = tl.load(tok_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
    elif BIAS_ROWS:
        token_bias = tl.load(bias_ptr + offs_t[:, None] * n_exp + offs_e[None, :],
                             mask=t_mask[:, None] & e_mask[None, :], other=0.0)
        sel = tl.where(e_mask[None, :], scores + token_bias, -3.0e38)
    else:
        bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
        sel = tl.where(e_mask[None, :], scores + bias[None, :], -3.0e38)
    offs_kk = tl.arange(0, K_PAD)
    picked = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        if HASH:
            idx = tl.load(tid2eid_ptr + tok * TOP_K + k, mask=t_mask, other=0).to(tl.int32)
        else:
            idx = tl.argmax(sel, axis=1).to(tl.int32)  # ties: lowest expert id
            sel = tl.where(offs_e[None, :] == idx[:, None], -3.0e38, sel)
        s_k = tl.sum(tl.where(offs_e[None, :] == idx[:, None], scores, 0.0), axis=1)
        picked = tl.where(offs_kk[None, :] == k, s_k[:, None], picked)
        ids = tl.where(offs_kk[None, :] == k, idx[:, None], ids)
    weights = picked / (tl.sum(picked, axis=1)[:, None] + 1e-20) * scaling
    out_off = offs_t[:, None] * TOP_K + offs_kk[None, :]
    out_mask = t_mask[:, None] & (offs_kk[None, :] < TOP_K)
    tl.store(w_out_ptr + out_off, weights, mask=out_mask)
    tl.store(id_out_ptr + out_off, ids, mask=out_mask)


@_jit
def _moe_route_kernel(
    x_ptr, gw_ptr, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr,
    n_tok, dim, n_exp, scaling,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, HASH: tl.constexpr, DOT_FP32: tl.constexpr, BIAS_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Router for BLOCK_T tokens: logits over all E experts in registers, then `_route_pick`."""
    pdl_prologue(PDL)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < n_tok
    offs_e = tl.arange(0, E_PAD)
    e_mask = offs_e < n_exp
    logits = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < dim
        xa = tl.load(x_ptr + offs_t[:, None] * dim + offs_k[None, :],
                     mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(gw_ptr + offs_e[:, None] * dim + offs_k[None, :],
                     mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            xa = xa.to(tl.float32)
        logits = _dot(xa, wg.to(xa.dtype), logits, DOT_FP32)  # bf16: exact products, fp32 sums
    _route_pick(logits, offs_t, t_mask, offs_e, e_mask, bias_ptr, tid2eid_ptr, tok_ptr, w_out_ptr, id_out_ptr,
                scaling, n_exp, TOP_K, K_PAD, BLOCK_T, HASH, BIAS_ROWS)


@_jit
def _weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, k0, n_out, n_in,
                 FP8: tl.constexpr, SB: tl.constexpr, dtype: tl.constexpr):
    """Tile W[e, offs_n, offs_k] as `dtype`; FP8 tiles are scaled by their UE8M0 factors: one per row
    when BLOCK_K divides SB (the tile lies in scale column k0 // SB), else BLOCK_K / SB per row (SB
    divides BLOCK_K: V4.1's 32-wide blocks in a 128-wide step), each broadcast over its SB columns."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    BLOCK_K: tl.constexpr = offs_k.shape[0]
    n_mask = offs_n < n_out
    mask = n_mask[:, None] & (offs_k[None, :] < n_in)
    w = tl.load(w_ptr + e * n_out * n_in + offs_n[:, None] * n_in + offs_k[None, :], mask=mask, other=0.0)
    if FP8:
        s_rows = tl.cdiv(n_out, SB)
        s_cols = tl.cdiv(n_in, SB)
        s_row = (e * s_rows + offs_n // SB) * s_cols
        if BLOCK_K > SB:
            KB: tl.constexpr = BLOCK_K // SB
            first = k0 // SB + tl.arange(0, KB)  # [KB] scale columns of the step
            byte = tl.load(s_ptr + s_row[:, None] + first[None, :],
                           mask=n_mask[:, None] & (first < s_cols)[None, :], other=127)
            factor = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
            w = tl.reshape(w.to(tl.float32), (BLOCK_N, KB, SB)) * factor[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        else:
            byte = tl.load(s_ptr + s_row + k0 // SB, mask=n_mask, other=127)
            factor = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
            w = w.to(tl.float32) * factor[:, None]
    return w.to(dtype)


@_jit
def _dot(a, b_t, acc, DOT_FP32: tl.constexpr):
    """acc + a·b_tᵀ; fp32 operands use 3-pass TF32 (≈ fp32 accuracy on the tensor cores)."""
    if DOT_FP32:
        acc = tl.dot(a, tl.trans(b_t), acc, input_precision="tf32x3")
    else:
        acc = tl.dot(a, tl.trans(b_t), acc)
    return acc


@_jit
def _split_store(y_ptr, part_ptr, ticket_ptr, out, t, s, offs_n, n_mask, dim, ticket_stride, SPLIT: tl.constexpr,
                 block):
    """A decode down kernel's fp32 row block `out` [BLOCK_N] (row block number `block`) of token t from
    program s of SPLIT: store it in part[t, s]; the last of the SPLIT programs of (t, row block) to take a
    ticket adds the parts in order s = 0..SPLIT − 1 (the same bits whichever arrives last), stores y and
    puts the counter back to 0 (zeroed by the up launch)."""
    tl.store(part_ptr + (t * SPLIT + s) * dim + offs_n, out, mask=n_mask)
    tl.debug_barrier()  # every thread's part stored before the ticket releases them (acq_rel, GPU scope)
    counter = ticket_ptr + t * ticket_stride + block
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
        total = tl.zeros(offs_n.shape, dtype=tl.float32)
        for p in tl.static_range(SPLIT):  # from L2 (.cg): other SMs stored these parts
            total += tl.load(part_ptr + (t * SPLIT + p) * dim + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + t * dim + offs_n, total.to(y_ptr.dtype.element_ty), mask=n_mask)
        tl.store(counter, 0)


@_jit
def _clamped_swiglu(gate, up, limit, CLAMP: tl.constexpr):
    """silu(min(gate, L)) · clamp(up, −L, L) in fp32: the SwiGLU clamp of V4 (§11.2) takes the gate from
    above only and the up projection on both sides; CLAMP False (L <= 0): plain SwiGLU."""
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@_jit
def _gemm_rows(pid_m, block_expert_ptr, rows_ptr, n_rows, n_exp, top_k,
               ROUTED: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, rows, input rows, input mask, output mask) of M-block pid_m; expert -1: unused block.

    Routed blocks cover rows of the packed list; with GATHER, row r holds assignment a = rows[r]
    (token·K + slot, or the sentinel n_rows for padding) whose input is row a // K of x. Padding rows
    read zeros and are still written, so every row of a used block is defined."""
    offs_r = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if ROUTED:
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        e = tl.where(e < n_exp, e, -1)
        out_mask = offs_r >= 0
        if GATHER:
            assign = tl.load(rows_ptr + offs_r).to(tl.int64)
            in_rows = assign // top_k
            in_mask = assign < n_rows
        else:
            in_rows = offs_r
            in_mask = out_mask
    else:
        e = (pid_m * 0).to(tl.int64)
        in_rows = offs_r
        in_mask = offs_r < n_rows
        out_mask = in_mask
    return e, offs_r, in_rows, in_mask, out_mask


@_jit
def _moe_up_kernel(
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, rows_ptr, block_expert_ptr, h_ptr,
    n_rows, dim, inter, n_exp, top_k, limit,
    ROUTED: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr, CLAMP: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """h[r, n] = silu(min(x·W1ᵀ, L)) · clamp(x·W3ᵀ, −L, L) for one [BLOCK_M, BLOCK_N] tile."""
    pdl_prologue(PDL)
    e, rows, in_rows, in_mask, out_mask = _gemm_rows(tl.program_id(0), block_expert_ptr, rows_ptr, n_rows,
                                                     n_exp, top_k, ROUTED, True, BLOCK_M)
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_ptr + in_rows[:, None] * dim + offs_k[None, :],
                     mask=in_mask[:, None] & (offs_k[None, :] < dim), other=0.0)
        if DOT_FP32:
            xa = xa.to(tl.float32)
        acc_g = _dot(xa, _weight_tile(w1_ptr, s1_ptr, e, offs_n, offs_k, k0, inter, dim, FP8, SB, xa.dtype),
                     acc_g, DOT_FP32)
        acc_u = _dot(xa, _weight_tile(w3_ptr, s3_ptr, e, offs_n, offs_k, k0, inter, dim, FP8, SB, xa.dtype),
                     acc_u, DOT_FP32)
    h = _clamped_swiglu(acc_g, acc_u, limit, CLAMP)
    tl.store(h_ptr + rows[:, None] * inter + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=out_mask[:, None] & (offs_n[None, :] < inter))


@_jit
def _moe_down_kernel(
    h_ptr, w2_ptr, s2_ptr, block_expert_ptr, out_ptr, n_rows, dim, inter, n_exp,
    ROUTED: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[r, n] = h[r]·W2[e, n]ᵀ in fp32 for one [BLOCK_M, BLOCK_N] tile (n over D)."""
    pdl_prologue(PDL)
    e, rows, _, in_mask, out_mask = _gemm_rows(tl.program_id(0), block_expert_ptr, block_expert_ptr, n_rows,
                                               n_exp, 1, ROUTED, False, BLOCK_M)
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ha = tl.load(h_ptr + rows[:, None] * inter + offs_k[None, :],
                     mask=in_mask[:, None] & (offs_k[None, :] < inter), other=0.0)
        acc = _dot(ha, _weight_tile(w2_ptr, s2_ptr, e, offs_n, offs_k, k0, dim, inter, FP8, SB, ha.dtype),
                   acc, DOT_FP32)
    tl.store(out_ptr + rows[:, None] * dim + offs_n[None, :], acc,
             mask=out_mask[:, None] & (offs_n[None, :] < dim))


@_jit
def _moe_finalize_kernel(routed_ptr, slot_ptr, w_ptr, shared_ptr, y_ptr, n_tok, dim,
                         TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """y[t] = shared[t] + Σ_k w[t, k] · routed[slot[t, k]] for a [BLOCK_T, BLOCK_D] tile."""
    pdl_prologue(PDL)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < n_tok
    mask = t_mask[:, None] & (offs_d[None, :] < dim)
    acc = tl.load(shared_ptr + offs_t[:, None] * dim + offs_d[None, :], mask=mask, other=0.0)
    for k in tl.static_range(TOP_K):
        slot = tl.load(slot_ptr + offs_t * TOP_K + k, mask=t_mask, other=0).to(tl.int64)
        w = tl.load(w_ptr + offs_t * TOP_K + k, mask=t_mask, other=0.0)
        acc += w[:, None] * tl.load(routed_ptr + slot[:, None] * dim + offs_d[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + offs_t[:, None] * dim + offs_d[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _pack_kernel(ids_ptr, rows_ptr, block_expert_ptr, slot_ptr, n_assign, n_exp, n_rows,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 PAD_J: tl.constexpr, PDL: tl.constexpr):
    """`_pack_by_expert` for the CHUNK assignments of one program: ids [N·K] int32 -> rows [R] int32,
    block_expert [R / BLOCK_M] int32, slot [N·K] int64 (E_PAD >= E, a power of two; the padding
    rows are stored PAD_J per expert at a time).

    Each program counts all assignments per expert and those before its chunk (N·K is small at
    decode sizes, so recounting is cheaper than a second launch to share the counts), then puts
    each of its assignments at its expert's padded start + the number of the same expert's earlier
    assignments: the order of a stable sort. Every used M-block holds a real row, so those stores
    also write each used block's expert. The sentinels go only where no real row goes (the padding
    inside each group, and the rows and blocks past the used ones), so no store needs ordering
    against another program's."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    c0 = pid * CHUNK
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([E_PAD], tl.int32)
    before = tl.zeros([E_PAD], tl.int32)  # assignments in the chunks before this program's
    for a0 in range(0, n_assign, BLOCK):
        valid = a0 + offs < n_assign
        e = tl.load(ids_ptr + a0 + offs, mask=valid, other=0)
        counts += tl.histogram(e, E_PAD, mask=valid)
        before += tl.histogram(e, E_PAD, mask=valid & (a0 + offs < c0))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded  # [E_PAD] first row of each expert's group
    offs_c = tl.arange(0, CHUNK)
    i = c0 + offs_c
    valid = i < n_assign
    e = tl.load(ids_ptr + i, mask=valid, other=0)
    same_before = (e[None, :] == e[:, None]) & (offs_c[None, :] < offs_c[:, None])  # [CHUNK, CHUNK]
    rank = tl.sum(same_before.to(tl.int32), axis=1)  # among the same expert's in this chunk
    dest = tl.gather(start + before, e, axis=0) + rank  # [CHUNK] row of each assignment
    tl.store(rows_ptr + dest, i, mask=valid)
    tl.store(slot_ptr + i, dest.to(tl.int64), mask=valid)
    tl.store(block_expert_ptr + dest // BLOCK_M, e, mask=valid)
    if pid == 0:  # padding rows inside the groups: positions counts..padded-1 of each expert's
        offs_j = tl.arange(0, PAD_J)
        for j0 in range(0, BLOCK_M, PAD_J):
            j = counts[:, None] + j0 + offs_j[None, :]  # [E_PAD, PAD_J]
            tl.store(rows_ptr + start[:, None] + j, tl.zeros([E_PAD, PAD_J], tl.int32) + n_assign,
                     mask=j < padded[:, None])
    used = tl.sum(padded, axis=0)  # rows of the used M-blocks; the rest, spread over the programs:
    step = tl.num_programs(0) * BLOCK
    for r0 in range(used + pid * BLOCK, n_rows, step):
        tl.store(rows_ptr + r0 + offs, tl.zeros([BLOCK], tl.int32) + n_assign, mask=r0 + offs < n_rows)
    for b0 in range(used // BLOCK_M + pid * BLOCK, n_rows // BLOCK_M, step):
        tl.store(block_expert_ptr + b0 + offs, tl.zeros([BLOCK], tl.int32) + n_exp,
                 mask=b0 + offs < n_rows // BLOCK_M)


# -------------------------------------------------------------------------------------- launchers


def _packed_rows(n_assign: int, n_exp: int, block_m: int) -> int:
    """R: the static bound on the packed rows, N·K + min(N·K, E)·(block_m − 1) rounded to block_m."""
    return -(-(n_assign + min(n_assign, n_exp) * (block_m - 1)) // block_m) * block_m


def _pack_by_expert(ids: torch.Tensor, n_exp: int, block_m: int):
    """Group the N·K assignments by expert, each group padded to a multiple of block_m (torch ops,
    no host sync: sizes come from the static bound, so the step is CUDA-graph capturable).

    Returns rows [R] int32 (assignment t·K + k per row, sentinel N·K on padding), block_expert
    [R / block_m] int32 (expert of each M-block; E for blocks past the used ones) and slot [N·K]
    int64 (the row of each assignment), with R = N·K + min(N·K, E)·(block_m − 1) rounded to block_m.
    """
    flat = ids.reshape(-1).long()  # [N·K]
    n_assign = flat.numel()
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order inside
    counts = torch.zeros(n_exp, dtype=torch.long, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    first_row = (pad_end - padded)[flat[order]]  # [N·K] padded start of each sorted assignment's expert
    first_rank = (torch.cumsum(counts, 0) - counts)[flat[order]]
    dest = first_row + torch.arange(n_assign, device=ids.device) - first_rank  # row of the i-th sorted
    n_rows = _packed_rows(n_assign, n_exp, block_m)
    rows = torch.full((n_rows,), n_assign, dtype=torch.int32, device=ids.device)
    rows.scatter_(0, dest, order.to(torch.int32))
    slot = torch.empty_like(dest).scatter_(0, order, dest)
    block_start = torch.arange(0, n_rows, block_m, device=ids.device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).to(torch.int32)
    return rows, block_expert, slot


def _launch_pack(ids: torch.Tensor, n_exp: int, block_m: int, chunk: int = 32, warps: int = 4):
    """`_pack_by_expert` (same arguments: ids [N, K] int; same outputs bit for bit) as one
    `_pack_kernel` launch, one program per `chunk` assignments (no host sync: graph-capturable).
    32 was the fastest of 16, 32 and 64 on the H200 up to 6144 assignments."""
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    n_assign = flat.numel()
    n_rows = _packed_rows(n_assign, n_exp, block_m)
    rows = torch.empty(n_rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(n_rows // block_m, dtype=torch.int32, device=ids.device)
    slot = torch.empty(n_assign, dtype=torch.int64, device=ids.device)
    e_pad = max(32, triton.next_power_of_2(n_exp))  # tl.histogram pads to one bin per lane anyway
    programs = max(1, triton.cdiv(n_assign, chunk))
    pdl = pdl_launch(ids.device, programs)
    _pack_kernel[(programs,)](
        flat, rows, block_expert, slot, n_assign, n_exp, n_rows, BLOCK_M=block_m, E_PAD=e_pad,
        CHUNK=chunk, BLOCK=1024, PAD_J=2048 // e_pad, PDL=pdl, launch_pdl=pdl,
        num_warps=warps,  # [E_PAD, PAD_J] tiles: no spills
    )
    return rows, block_expert, slot


# Up to this many (token, expert) assignments the packing is `_pack_kernel` (one launch), above it
# the torch sort (~27 launches, which prefill's GEMMs dwarf). Each of the kernel's N·K / 32 programs
# recounts all N·K assignments, so its work grows as (N·K)². Replayed in a CUDA graph on one H200
# (`bench/moe_pack.py`, E 64 / 256 / 384): 2.5-6.0 µs up to 768 assignments, 11 / 19 / 34 µs at 8190,
# against 55-148 µs for the torch packing; at the bound the kernel still takes at most a quarter of
# that, short of where the square takes over.
PACK_KERNEL_MAX_ASSIGNMENTS = 8192


def _pack_assignments(ids: torch.Tensor, n_exp: int, block_m: int):
    """The packing of `_packed_experts`: `_launch_pack` up to PACK_KERNEL_MAX_ASSIGNMENTS, else
    `_pack_by_expert` (same outputs)."""
    if 0 < ids.numel() <= PACK_KERNEL_MAX_ASSIGNMENTS:
        return _launch_pack(ids, n_exp, block_m)
    return _pack_by_expert(ids, n_exp, block_m)


def _tiles(rows_per_expert: float):
    """(BLOCK_M, up (BLOCK_N, BLOCK_K, warps), down (BLOCK_N, BLOCK_K, warps)) for the grouped GEMMs.

    Decode packs few rows per expert: the M-tile is the tensor cores' minimum (16) and the grid
    spreads over the weight rows; prefill uses 64-row tiles. The decode shapes are the fastest of
    `bench/moe_packed_tiles.py`'s sweep on the H200 (V4-Flash layer, 16 / 64 / 256 tokens): a
    128-wide K step streams the weight at 87-88 % of HBM for FP8 128x128 where the 64-wide one
    reached 53-55 %, and 99 % for bf16 (94-96 %). The prefill shapes are the largest that compile
    for sm_90 without register spills (the gate/up kernel holds two accumulators). A K step wider
    than an FP8 scale block takes several scales per row (`_weight_tile`)."""
    if rows_per_expert <= 32:
        return 16, (64, 128, 4), (64, 128, 4)
    return 64, (128, 32, 8), (128, 64, 8)


def _block_k(block_k: int, fp8: bool, sb: int, max_blocks: int | None = None) -> int:
    """The K step a launch takes: an FP8 step lies in one scale block of width sb or covers whole ones
    (at most `max_blocks` of them); dense weights take any step."""
    if not fp8:
        return block_k
    if block_k > sb and block_k % sb == 0:
        return block_k if max_blocks is None else min(block_k, max_blocks * sb)
    return min(block_k, sb)


def _weight_parts(w):
    """(data, scale, is_fp8, scale_block) kernel arguments of a dense or FP8 weight."""
    if isinstance(w, FP8BlockWeight):
        return w.data.contiguous(), w.scale.contiguous(), True, w.block
    return w.contiguous(), w, False, 16  # scale pointer unused when not FP8


def _launch_up(x, w1, w3, rows, block_expert, n_rows, n_out_rows, top_k, limit, tiles):
    """h [n_out_rows, I] x.dtype = clamped SwiGLU of the gate/up GEMMs (rows=None: shared expert)."""
    d1, s1, fp8, sb = _weight_parts(w1)
    d3, s3, _, _ = _weight_parts(w3)
    n_exp, inter, dim = (1, *d1.shape) if d1.dim() == 2 else d1.shape
    block_m, (block_n, block_k, warps), _ = tiles
    h = torch.empty((n_out_rows, inter), dtype=x.dtype, device=x.device)
    routed = rows is not None
    grid = (triton.cdiv(n_out_rows, block_m), triton.cdiv(inter, block_n))
    pdl = pdl_launch(x.device, math.prod(grid))
    _moe_up_kernel[grid](
        x, d1, d3, s1, s3, rows if routed else x, block_expert if routed else x, h,
        n_rows, dim, inter, n_exp, top_k, float(limit),
        ROUTED=routed, FP8=fp8, SB=sb, CLAMP=limit > 0, DOT_FP32=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(block_k, fp8, sb), PDL=pdl, launch_pdl=pdl,
        num_warps=warps,
    )
    return h


def _launch_down(h, w2, block_expert, n_rows, tiles):
    """out [rows of h, D] fp32 = h·W2ᵀ per row's expert (block_expert=None: shared expert)."""
    d2, s2, fp8, sb = _weight_parts(w2)
    n_exp, dim, inter = (1, *d2.shape) if d2.dim() == 2 else d2.shape
    block_m, _, (block_n, block_k, warps) = tiles
    out = torch.empty((h.shape[0], dim), dtype=torch.float32, device=h.device)
    routed = block_expert is not None
    grid = (triton.cdiv(h.shape[0], block_m), triton.cdiv(dim, block_n))
    pdl = pdl_launch(h.device, math.prod(grid))
    _moe_down_kernel[grid](
        h, d2, s2, block_expert if routed else h, out, n_rows, dim, inter, n_exp,
        ROUTED=routed, FP8=fp8, SB=sb, DOT_FP32=h.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(block_k, fp8, sb), PDL=pdl, launch_pdl=pdl,
        num_warps=warps,
    )
    return out


# Router calls of at most this many tokens take `moe_route_decode` (split-K logits over ~128 programs,
# then a select kernel) instead of `_moe_route_kernel`, whose grid is one program per 16 tokens, each
# looping over all of D: up to 256 tokens that is <= 16 of the H200's 132 SMs, and its time stays at
# its serial floor (31-32 µs for v4-mini, 66-69 µs for V4-Flash at 1, 8, 64 and 256 tokens in
# bench/results/kernels-h200.json). `bench/route_decode.py` times both paths at 1 to 4096 tokens.
ROUTE_DECODE_MAX_TOKENS = 256


def moe_route(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int,
              routed_scaling_factor: float, hash_routing: bool, bias_rows: bool = False):
    """Fused `moe_route_ref` (same signature): up to ROUTE_DECODE_MAX_TOKENS tokens the two
    split-K kernels of `moe_route_decode`; above, one kernel whose logits never leave registers.
    `bias_rows`: gate_bias is [N, E] (`moe_route_rows`)."""
    require_triton()
    _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing, bias_rows)
    kwargs = dict(top_k=top_k, routed_scaling_factor=routed_scaling_factor, hash_routing=hash_routing,
                  bias_rows=bias_rows)
    if 0 < x.shape[0] <= ROUTE_DECODE_MAX_TOKENS:
        from dspark.kernels import moe_route_decode  # here, not at the top: it imports this module

        return moe_route_decode.route_decode(x, gate_weight, gate_bias, tid2eid, token_ids, **kwargs)
    return route_prefill(x, gate_weight, gate_bias, tid2eid, token_ids, **kwargs)


def moe_route_rows_ref(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int,
                       routed_scaling_factor: float, hash_routing: bool = False):
    """`moe_route_ref` with one selection-bias row per token: gate_bias [N, E] fp32 (V4.1's gate,
    whose image-span tokens select with `bias_vl`), score routing only. Same returns."""
    return moe_route_ref(x, gate_weight, gate_bias, tid2eid, token_ids, top_k=top_k,
                         routed_scaling_factor=routed_scaling_factor, hash_routing=hash_routing, bias_rows=True)


def moe_route_rows(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int,
                   routed_scaling_factor: float, hash_routing: bool = False):
    """Fused `moe_route_rows_ref`: `moe_route`'s kernels, each token's bias row loaded in the epilogue."""
    return moe_route(x, gate_weight, gate_bias, tid2eid, token_ids, top_k=top_k,
                     routed_scaling_factor=routed_scaling_factor, hash_routing=hash_routing, bias_rows=True)


def route_prefill(x, gate_weight, gate_bias, tid2eid, token_ids, *, top_k: int,
                  routed_scaling_factor: float, hash_routing: bool, bias_rows: bool = False):
    """The prefill-sized path of `moe_route` (same signature), at any token count."""
    require_triton()
    _check_route_args(x, gate_weight, gate_bias, tid2eid, token_ids, top_k, hash_routing, bias_rows)
    n_tok, dim = x.shape
    n_exp = gate_weight.shape[0]
    weights = torch.empty((n_tok, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((n_tok, top_k), dtype=torch.int32, device=x.device)
    x = x.contiguous()
    e_pad = max(16, triton.next_power_of_2(n_exp))  # tl.dot needs N >= 16 on the GPU
    # All E logits of a token tile stay in registers; 8 warps and K-steps of 32 keep them unspilled.
    # Larger token tiles re-read W_g (2 MB for Flash) from L2 less often, but leave SMs idle below ~4k.
    block_t = 32 if n_tok > 2048 and e_pad <= 256 else 16
    programs = triton.cdiv(n_tok, block_t)
    pdl = pdl_launch(x.device, programs)
    _moe_route_kernel[(programs,)](
        x, gate_weight.contiguous(), x if hash_routing else gate_bias.float().contiguous(),
        tid2eid.contiguous() if hash_routing else x, token_ids.contiguous() if hash_routing else x,
        weights, ids, n_tok, dim, n_exp, float(routed_scaling_factor),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad,
        BLOCK_T=block_t, BLOCK_K=32, HASH=bool(hash_routing), num_warps=8,
        DOT_FP32=x.dtype == torch.float32 or gate_weight.dtype == torch.float32, PDL=pdl, launch_pdl=pdl,
        BIAS_ROWS=bias_rows,
    )
    return weights, ids


# Decode-sized calls (at most this many (token, expert) assignments) skip the packing and run the
# GEMV kernels of `moe_decode` over the picked experts' weights: 2 launches instead of ~20.
DECODE_MAX_ASSIGNMENTS = 64


def moe_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *,
                swiglu_limit: float, x_ready: bool = False, counters=None) -> torch.Tensor:
    """Fused `moe_experts_ref` (same signature): with at most DECODE_MAX_ASSIGNMENTS assignments,
    the two decode GEMV kernels; otherwise packing, two grouped GEMMs (SwiGLU in the first one's
    epilogue) for routed and shared experts, and one finalize. `x_ready`: the caller's promise that
    its last launch before this call (the router's) did not write x (nor anything else the shared
    expert reads); the decode path then starts the shared expert while that launch still runs
    (`moe_decode.decode_experts`; where it runs the experts as one launch, only given `counters`, the
    caller's `experts_counters` made before the router). The same result either way."""
    require_triton()
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    n_exp = w1.shape[0]
    _check_routing_args(x, weights, ids, n_exp)
    _check_expert_args(x, n_exp, w1, w2, w3, shared_w1, shared_w2, shared_w3)
    x_ready = x_ready and x.is_contiguous()  # else the copy below is the launch right before the experts
    x = x.contiguous()
    weights, ids = weights.float().contiguous(), ids.to(torch.int32).contiguous()
    if ids.numel() <= DECODE_MAX_ASSIGNMENTS:
        from dspark.kernels import moe_decode  # here, not at the top: moe_decode imports this module

        return moe_decode.decode_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3,
                                         swiglu_limit, x_ready=x_ready, counters=counters)
    return _packed_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit)


def _packed_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit, tiles=None):
    """The prefill-sized path of `moe_experts` (checked, contiguous inputs; ids int32). `tiles`
    (`_tiles`' form) overrides the routed experts' launch shapes (tests, benches)."""
    n_tok, dim = x.shape
    n_exp, top_k = w1.shape[0], ids.shape[1]
    n_assign = n_tok * top_k
    tiles = _tiles(n_assign / min(n_exp, n_assign)) if tiles is None else tiles
    rows, block_expert, slot = _pack_assignments(ids, n_exp, tiles[0])
    h = _launch_up(x, w1, w3, rows, block_expert, n_assign, rows.numel(), top_k, swiglu_limit, tiles)
    routed = _launch_down(h, w2, block_expert, n_assign, tiles)  # [R, D] fp32
    shared_tiles = _tiles(n_tok)
    h_shared = _launch_up(x, shared_w1, shared_w3, None, None, n_tok, n_tok, 1, swiglu_limit, shared_tiles)
    shared = _launch_down(h_shared, shared_w2, None, n_tok, shared_tiles)  # [N, D] fp32
    return launch_finalize(routed, slot, weights, shared, x.dtype)


def launch_finalize(routed, slot, weights, shared, dtype: torch.dtype) -> torch.Tensor:
    """y [N, D] `dtype`, y[t] = shared[t] + Σ_k weights[t, k] · routed[slot[t·K + k]]: routed [R, D] and
    shared [N, D] fp32 rows, slot [N·K] (each assignment's packed row), weights [N, K] fp32."""
    n_tok, top_k = weights.shape
    dim = shared.shape[1]
    y = torch.empty((n_tok, dim), dtype=dtype, device=shared.device)
    block_t, block_d = 4, min(256, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n_tok, block_t), triton.cdiv(dim, block_d))
    pdl = pdl_launch(shared.device, math.prod(grid))
    _moe_finalize_kernel[grid](
        routed, slot, weights, shared, y, n_tok, dim, TOP_K=top_k, BLOCK_T=block_t, BLOCK_D=block_d,
        PDL=pdl, launch_pdl=pdl,
    )
    return y


def experts_counters(x, w1, w2, w3, shared_w1, shared_w2, shared_w3, top_k: int):
    """`moe_experts`' `counters` for a call on x [N, D] with top-k routing (checked weights), made before the
    router launches: zeroed counters where the decode path runs the experts as one launch that may start
    early (`moe_decode.fused_counters`), else None."""
    if x.dim() != 2 or x.shape[0] * top_k > DECODE_MAX_ASSIGNMENTS:
        return None
    from dspark.kernels import moe_decode  # here, not at the top: moe_decode imports this module

    return moe_decode.fused_counters(x, w1, w2, w3, shared_w1, shared_w2, shared_w3, top_k)


def fused_moe(x, gate_weight, gate_bias, tid2eid, token_ids, w1, w2, w3, shared_w1, shared_w2,
              shared_w3, *, top_k: int, routed_scaling_factor: float, swiglu_limit: float,
              hash_routing: bool) -> torch.Tensor:
    """Fused `fused_moe_ref` (same signature, shapes and dtypes): the router kernel, then
    `moe_experts`, told that x was written before the router ran (`x_ready`: its shared expert may start
    while the router's last launch runs; the counters of a one-launch experts call are zeroed before the
    router, `experts_counters`)."""
    require_triton()
    _check_expert_args(x, gate_weight.shape[0], w1, w2, w3, shared_w1, shared_w2, shared_w3)
    counters = experts_counters(x, w1, w2, w3, shared_w1, shared_w2, shared_w3, top_k)
    weights, ids = moe_route(x, gate_weight, gate_bias, tid2eid, token_ids, top_k=top_k,
                             routed_scaling_factor=routed_scaling_factor, hash_routing=hash_routing)
    return moe_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit=swiglu_limit,
                       x_ready=True, counters=counters)
