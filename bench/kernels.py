"""Fused kernels vs their torch references on one GPU (dspark/kernels).

For each op at decode-sized (M = 1, 8, 64, 256 tokens) and prefill-sized (M = 4096) inputs of a
V4-Flash-like layer and of the v4-mini layer, it times the fused (Triton) op with
`triton.testing.do_bench` (CUDA events, L2 flushed before each run, median) and its `_ref` with a
bounded CUDA-event loop (median), checks the fused output against the reference, and reports
effective bandwidth and rate against the floors:

* bytes = the fewest bytes the op must move (each input read once, each output written once;
  for MoE only the weights of the experts the router actually picked), GB/s = bytes / time;
* FLOP = the arithmetic of the op's GEMMs; TFLOP/s = FLOP / time;
* % HBM of 4.4 TB/s and % bf16 of 790 TFLOP/s: the ceilings measured on one H200 (peers.md §7.1).

    python bench/kernels.py                      # everything, JSON to bench/results/kernels.json
    python bench/kernels.py --configs mini --ops mhc_pre,fused_moe --tokens 1,4096
    python bench/kernels.py --dry-run            # list the cases (works without a GPU)
    python bench/kernels.py --configs flash --ops fused_moe_fp8_128,fused_moe_fp8_32,fused_moe --tokens 1,8,16,64 \
        --model-steps 0 --graph                  # fused ops timed as CUDA-graph replays
    python bench/kernels.py --configs flash --ops indexer_csa,indexer_v41 --tokens 1,8,64,256
    python bench/kernels.py --configs flash --ops mhc_v41_pre,mhc_v41_post_pre,indexer_pool --model-steps 0
    python bench/kernels.py --ops grouped_wo_a --model-steps 0 --out bench/results/kernels_wo_a.json
    python bench/kernels.py --ops rms_norm,rms_norm_q,rope_q --model-steps 0 --out bench/results/kernels_norm_rope.json

Conditions (GPU, clocks, torch/triton versions, commit) are printed first and stored in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

HBM_BYTES_PER_S = 4.4e12  # measured copy bandwidth of one H200 (peers.md §7.1)
BF16_FLOP_PER_S = 790e12  # measured 8192³ bf16 GEMM rate (peers.md §7.1)
TOKENS = (1, 8, 64, 256, 4096)
OPS = ("mhc_pre", "mhc_post", "mhc_post_pre", "mhc_v41_pre", "mhc_v41_post_pre", "moe_route", "fused_moe", "fused_moe_packed", "fused_moe_fp8_128",
       "fused_moe_fp8_32", "attn_swa", "attn_hca", "attn_csa", "indexer_csa", "indexer_v41",
       "indexer_pool", "compressor_csa", "compressor_hca", "grouped_wo_a", "rms_norm", "rms_norm_q", "rope_q",
       "linear_wkv", "compressor_project", "index_scores")
DECODE_ONLY = ("indexer_csa", "indexer_v41", "indexer_pool", "index_scores")  # decode / verify ops: M <= 256 rows
COMPRESSOR_SLOTS = {"compressor_csa": 8, "compressor_hca": 128}  # rows pooled per entry (CSA: 2m half-rows)
CONTEXT = 32768  # attention cases: queries at the end of a 32K-token context
WINDOW, HCA_RATE, CSA_RATE, CSA_TOPK = 128, 128, 4, 512  # V4 attention (spec §7-§8)
INDEX_DIM, V41_INDEX_HEADS, V41_POOL_BLOCKS, V41_POOL_BLOCK = 128, 32, 2048, 8  # deepseek_v41 spec §5.3-§5.4
MODEL_CONFIG = "dspark/configs/v4-mini.json"  # whole-model step: the copy of ../shared/bench/v4-mini.json
EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's kernel-relevant sizes."""

    name: str
    dim: int  # D
    n_hc: int  # mHC streams
    n_experts: int  # E
    top_k: int  # K
    inter: int  # I, routed and shared expert width
    n_heads: int = 64  # attention heads H (head_dim 512, one shared KV latent)
    head_dim: int = 512
    index_heads: int = 64  # V4 lightning indexer Hi (di = 128, top-512)
    o_groups: int = 8  # G: wo_a is [G·R, H·d/G]
    o_rank: int = 1024  # R
    rope_dim: int = 64  # rd


CONFIGS = {
    "flash": LayerShape("v4-flash", dim=4096, n_hc=4, n_experts=256, top_k=6, inter=2048),  # spec §2.2
    "mini": LayerShape("v4-mini", dim=2048, n_hc=4, n_experts=64, top_k=6, inter=512, n_heads=32,
                  o_groups=4, o_rank=512),  # shared/bench/v4-mini.json
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/kernels.json", help="JSON output path")
    p.add_argument("--configs", default="flash,mini", help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of ops")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of token counts M")
    p.add_argument("--flash-experts", type=int, default=256, help="scale E of the flash layer down if memory needs")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse; copies may lack .git)")
    p.add_argument("--model-steps", type=int, default=8, help="timed decode steps of the whole-model case (0: skip)")
    p.add_argument("--dry-run", action="store_true", help="print the cases and exit (no GPU needed)")
    p.add_argument("--graph", action="store_true",
                   help="time the fused op by CUDA-graph replays, L2 flushed (bench.attn_batched.graph_timer): "
                        "what it costs in a captured step, without the eager launch overhead")
    p.add_argument("--flush", default="read", choices=("write", "read"),
                   help="--graph's L2 flush before each replay (bench.attn_batched.graph_timer): a 256 MB read "
                        "(default), or a 256 MB write, whose dirty lines the op then writes back (before the "
                        "forty-second session)")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.ops = [o for o in args.ops.split(",") if o]
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    for name, given, known in (("config", args.configs, CONFIGS), ("op", args.ops, OPS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            p.error(f"unknown {name}(s) {unknown}; known: {sorted(known)}")
    return args


def layer_shapes(args: argparse.Namespace) -> list[LayerShape]:
    shapes = []
    for name in args.configs:
        shape = CONFIGS[name]
        if name == "flash" and args.flash_experts != shape.n_experts:
            shape = dataclasses.replace(shape, name=f"{shape.name}-E{args.flash_experts}",
                                        n_experts=args.flash_experts)
        shapes.append(shape)
    return shapes


def plan(args: argparse.Namespace) -> list[tuple[LayerShape, str, int]]:
    """Every (layer, op, M) case, in run order."""
    # Above M·K = 64 assignments fused_moe itself takes the packed path: fused_moe_packed would repeat it.
    # The indexer ops are decode / verify ops (a prefill scores in row chunks): M <= 256 only.
    return [(shape, op, m) for shape in layer_shapes(args) for op in args.ops for m in args.tokens
            if not (op == "fused_moe_packed" and m * shape.top_k > 64) and not (op in DECODE_ONLY and m > 256)]


def conditions(commit: str) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    clocks = "unknown"
    try:
        clocks = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                                 "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "commit": commit,
            "clocks_sm_mem_power_temp": clocks, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hbm_ceiling_TBps": HBM_BYTES_PER_S / 1e12, "bf16_ceiling_TFLOPs": BF16_FLOP_PER_S / 1e12}


# ------------------------------------------------------------------------------------------ inputs


def build_layer(shape: LayerShape, device: str) -> dict:
    """Random layer parameters on the GPU (never zeros): mHC site, router, bf16 and FP8 experts."""
    from dspark.kernels.fp8 import FP8BlockWeight

    gen = torch.Generator(device=device).manual_seed(0)
    d, e, i = shape.dim, shape.n_experts, shape.inter
    n_mix = (2 + shape.n_hc) * shape.n_hc

    def randn(*size, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    layer = {
        "fn": randn(n_mix, shape.n_hc * d, scale=0.02, dtype=torch.float32),
        "base": randn(n_mix, scale=0.5, dtype=torch.float32),
        "scale": torch.rand(3, generator=gen, device=device) + 0.5,
        "gate": randn(e, d, scale=d ** -0.5), "bias": randn(e, scale=0.1, dtype=torch.float32),
        "bf16": (randn(e, i, d, scale=d ** -0.5), randn(e, d, i, scale=i ** -0.5), randn(e, i, d, scale=d ** -0.5),
                 randn(i, d, scale=d ** -0.5), randn(d, i, scale=i ** -0.5), randn(i, d, scale=d ** -0.5)),
    }
    for block in (128, 32):
        layer[f"fp8_{block}"] = tuple(quantize_per_expert(w, block, FP8BlockWeight) for w in layer["bf16"])
    return layer


def quantize_per_expert(w: torch.Tensor, block: int, cls):
    """FP8BlockWeight of a stacked [E, out, in] weight, one expert at a time (bounded temporaries)."""
    if w.dim() == 2:
        return cls.quantize(w, block)
    parts = [cls.quantize(w[e], block) for e in range(w.shape[0])]
    return cls(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), block)


def weight_bytes(w) -> int:
    if hasattr(w, "data") and hasattr(w, "block"):
        return w.data.numel() + w.scale.numel()
    return w.numel() * w.element_size()


# ------------------------------------------------------------------------------------------- cases


def mhc_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of one mHC op at M tokens, bf16 streams."""
    from dspark.kernels import mhc

    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, shape.n_hc, shape.dim, generator=gen, device=device).bfloat16()
    f = torch.randn(m, shape.dim, generator=gen, device=device).bfloat16()
    site = (layer["fn"], layer["base"], layer["scale"])
    post, comb, _ = mhc.mhc_pre_ref(x, *site, **EPS)
    streams, row, fn_bytes = x.numel() * 2, m * shape.dim * 2, layer["fn"].numel() * 4
    gemm_flop = 2 * m * layer["fn"].shape[0] * layer["fn"].shape[1]
    if op == "mhc_pre":
        args, kw, n_bytes, flop = (x, *site), EPS, streams + fn_bytes + row, gemm_flop
    elif op == "mhc_post":
        args, kw, n_bytes, flop = (f, x, post, comb), {}, 2 * streams + row, 2 * m * shape.n_hc ** 2 * shape.dim
    else:
        args, kw, n_bytes, flop = (f, x, post, comb, *site), EPS, 2 * streams + 2 * row + fn_bytes, gemm_flop
    fused, ref = getattr(mhc, op), getattr(mhc, f"{op}_ref")
    return (lambda: fused(*args, **kw)), (lambda: ref(*args, **kw)), n_bytes, flop


def mhc_v41_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of one V4.1 single-pass mHC site at M tokens, bf16
    streams. Bytes: streams (and for the post+pre site f, post, comb) read once, Y written once, fn,
    the carried pre and the norm weight read once, pre/post/comb and h written once; the collapse
    u that the kernels store and re-read (2 rows) is not in the floor."""
    from dspark.kernels import mhc, mhc_v41

    gen = torch.Generator(device=device).manual_seed(m)
    h, d = shape.n_hc, shape.dim
    x = torch.randn(m, h, d, generator=gen, device=device).bfloat16()
    f = torch.randn(m, d, generator=gen, device=device).bfloat16()
    pre_in = torch.rand(m, h, generator=gen, device=device) + 0.1
    weight = torch.rand(d, generator=gen, device=device) + 0.5
    site = (layer["fn"], layer["base"], layer["scale"])
    post, comb, _ = mhc.mhc_pre_ref(x, *site, **EPS)
    streams, row, fn_bytes = x.numel() * 2, m * d * 2, layer["fn"].numel() * 4
    mixes = m * (2 * h + h * h) * 4  # pre, post, comb fp32
    n_bytes = streams + fn_bytes + m * h * 4 + d * 4 + mixes + row
    flop = 2 * m * layer["fn"].shape[0] * layer["fn"].shape[1]
    kw = dict(EPS, norm_eps=1e-6)
    if op == "mhc_v41_pre":
        args = (x, pre_in, *site, weight)
    else:
        args = (f, x, post, comb, pre_in, *site, weight)
        n_bytes += streams + row + m * (h + h * h) * 4
        flop += 2 * m * h * h * d
    fused, ref = getattr(mhc_v41, op), getattr(mhc_v41, f"{op}_ref")
    return (lambda: fused(*args, **kw)), (lambda: ref(*args, **kw)), n_bytes, flop


def moe_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of the router or the whole MoE at M tokens, bf16 x."""
    from dspark.kernels import moe

    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, shape.dim, generator=gen, device=device).bfloat16()
    router = (x, layer["gate"], layer["bias"], None, None)
    route_kw = dict(top_k=shape.top_k, routed_scaling_factor=1.5, hash_routing=False)
    route_bytes = x.numel() * 2 + layer["gate"].numel() * 2
    route_flop = 2 * m * shape.n_experts * shape.dim
    if op == "moe_route":
        return (lambda: moe.moe_route(*router, **route_kw)), (lambda: moe.moe_route_ref(*router, **route_kw)), \
            route_bytes, route_flop
    weights = layer["bf16" if op in ("fused_moe", "fused_moe_packed") else op.replace("fused_moe_", "")]
    _, ids = moe.moe_route_ref(*router, **route_kw)
    touched = int(torch.unique(ids).numel())  # host sync here, outside the timed region
    per_expert = sum(weight_bytes(w) for w in weights[:3]) // shape.n_experts
    n_bytes = route_bytes + touched * per_expert + sum(weight_bytes(w) for w in weights[3:]) + x.numel() * 2
    flop = route_flop + 2 * m * (shape.top_k + 1) * 3 * shape.inter * shape.dim
    kw = dict(route_kw, swiglu_limit=10.0)
    ref = lambda: moe.fused_moe_ref(*router, *weights, **kw)  # noqa: E731
    if op == "fused_moe_packed":  # the packed path at every M (fused_moe takes the decode path for M·K <= 64)
        def packed():
            w, i = moe.moe_route(*router, **route_kw)
            return moe._packed_experts(x, w, i, *weights, 10.0)
        return packed, ref, n_bytes, flop
    return (lambda: moe.fused_moe(*router, *weights, **kw)), ref, n_bytes, flop


def attention_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of sparse attention for M query rows at the end of a
    32K context: window 128 (attn_swa), + all 256 HCA entries (attn_hca), or + the top-512 of 8192
    CSA entries (attn_csa). Bytes count each distinct pool row once (the keys M queries share)."""
    from dspark.kernels import attention

    gen = torch.Generator(device=device).manual_seed(m)
    h, d = shape.n_heads, shape.head_dim
    positions = torch.arange(CONTEXT - m, CONTEXT, device=device)
    index = positions[:, None] - (WINDOW - 1) + torch.arange(WINDOW, device=device)  # [M, W], rows = positions
    n_raw = CONTEXT
    if op == "attn_hca":
        entries = CONTEXT // HCA_RATE
        w = torch.arange(entries, device=device)
        index = torch.cat((index, torch.where(w < ((positions + 1) // HCA_RATE)[:, None], w + n_raw, -1)), 1)
    elif op == "attn_csa":
        entries = CONTEXT // CSA_RATE
        picks = torch.rand(m, entries, generator=gen, device=device).topk(CSA_TOPK, dim=-1).indices
        index = torch.cat((index, picks + n_raw), 1)
    else:
        entries = 0
    pool = (torch.randn(n_raw + entries, d, generator=gen, device=device) * 0.5).bfloat16()
    q = torch.randn(m, h, d, generator=gen, device=device).bfloat16()
    sink = torch.randn(h, generator=gen, device=device) * 0.5
    args = (q, pool, index, sink, d ** -0.5)
    rows = int(torch.unique(index[index >= 0]).numel())  # host sync outside the timed region
    n_bytes = rows * d * 2 + 2 * q.numel() * 2 + index.numel() * 8
    flop = 4 * m * h * index.shape[1] * d
    return (lambda: attention.sparse_attention(*args)), (lambda: attention.sparse_attention_ref(*args)), \
        n_bytes, flop


def indexer_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of the lightning indexer for M query rows at the end of
    a 32K context: V4 CSA (indexer_csa: Hi of the layer, T = 8192 entries, top-512) or V4.1
    reindex (indexer_v41: 32 heads, ratio 1 so T = 32768, top-512 inside a candidate pool of 2048
    blocks of 8 = half the entries). Bytes: keys, q, weights and the pool mask read once; scores
    [M, T] fp32 and ids written once."""
    from dspark.kernels import indexer

    gen = torch.Generator(device=device).manual_seed(m)
    v41 = op == "indexer_v41"
    heads, n_keys = (V41_INDEX_HEADS, CONTEXT) if v41 else (shape.index_heads, CONTEXT // CSA_RATE)
    q = torch.randn(m, heads, INDEX_DIM, generator=gen, device=device).bfloat16()
    keys = torch.randn(n_keys, INDEX_DIM, generator=gen, device=device).bfloat16()
    weights = torch.randn(m, heads, generator=gen, device=device) * (heads * INDEX_DIM) ** -0.5
    visible = torch.full((m,), n_keys, device=device)
    pool = None
    if v41:
        n_blocks = n_keys // V41_POOL_BLOCK
        n_kept = min(V41_POOL_BLOCKS, n_blocks // 2)  # half the blocks at 32K (the pool binds)
        kept = torch.rand(m, n_blocks, generator=gen, device=device).topk(n_kept, dim=-1).indices
        pool = torch.zeros(m, n_blocks, dtype=torch.bool, device=device).scatter_(1, kept, True)
        pool = pool.repeat_interleave(V41_POOL_BLOCK, dim=1)
    args, kw = (q, weights, keys, visible, pool), dict(topk=CSA_TOPK)
    n_bytes = (keys.numel() + q.numel()) * 2 + weights.numel() * 4 + m * n_keys * 4 + m * CSA_TOPK * 8
    n_bytes += 0 if pool is None else pool.numel()
    flop = 2 * m * heads * n_keys * INDEX_DIM
    return (lambda: indexer.lightning_indexer(*args, **kw)), (lambda: indexer.lightning_indexer_ref(*args, **kw)), \
        n_bytes, flop


def pool_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of the V4.1 candidate pool for M query rows at the end
    of a 32K context (ratio 1: T = 32768 entries, blocks of 8, the best 2048 blocks kept: the pool
    binds above 16384 entries). Bytes: the masked scores [M, T] fp32 read once, the mask written once."""
    from dspark.kernels import indexer_pool

    gen = torch.Generator(device=device).manual_seed(m)
    scores = torch.randn(m, CONTEXT, generator=gen, device=device).clamp(min=0)  # ReLU-like: ties at 0
    visible = CONTEXT - m + 1 + torch.arange(m, device=device)  # rows at the end of the context
    scores = scores.masked_fill(torch.arange(CONTEXT, device=device) >= visible[:, None], float("-inf"))
    kw = dict(topk_blocks=V41_POOL_BLOCKS, block=V41_POOL_BLOCK)
    n_bytes = m * CONTEXT * (4 + 1) + m * 8
    return (lambda: indexer_pool.indexer_pool(scores, visible, **kw)), \
        (lambda: indexer_pool.indexer_pool_ref(scores, visible, **kw)), n_bytes, 0


def compressor_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of the compressor update emitting M entries of width
    d = head_dim: CSA (8 overlapping half-rows each) or HCA (128 rows each), bf16 values, fp32
    logits. Bytes: values and logits read once, entries written once."""
    from dspark.kernels import compressor

    gen = torch.Generator(device=device).manual_seed(m)
    slots, d = COMPRESSOR_SLOTS[op], shape.head_dim
    kv = torch.randn(m, slots, d, generator=gen, device=device).bfloat16()
    score = torch.randn(m, slots, d, generator=gen, device=device)
    weight = torch.rand(d, generator=gen, device=device) + 0.5
    kw = dict(eps=1e-6, out_dtype=torch.bfloat16)
    n_bytes = kv.numel() * 2 + score.numel() * 4 + d * 4 + m * d * 2
    flop = 2 * kv.numel()
    return (lambda: compressor.compressor_pool(kv, score, weight, **kw)), \
        (lambda: compressor.compressor_pool_ref(kv, score, weight, **kw)), n_bytes, flop


def wo_a_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of the inverse RoPE + grouped wo_a for M rows, bf16
    (V4-Flash wo_a [8192, 4096], v4-mini [2048, 4096]). Bytes: the weight, the attention output
    [M, H, d] and cos/sin read once, [M, G·R] written once."""
    from dspark.kernels import grouped_wo_a

    gen = torch.Generator(device=device).manual_seed(m)
    h, d, g, r = shape.n_heads, shape.head_dim, shape.o_groups, shape.o_rank
    out = torch.randn(m, h, d, generator=gen, device=device).bfloat16()
    angles = torch.randint(0, CONTEXT, (m, 1), generator=gen, device=device) * \
        torch.rand(shape.rope_dim // 2, generator=gen, device=device)
    cos, sin = angles.cos(), angles.sin()
    weight = (torch.randn(g * r, h * d // g, generator=gen, device=device) * (h * d // g) ** -0.5).bfloat16()
    args = (out, cos, sin, weight)
    n_bytes = weight.numel() * 2 + out.numel() * 2 + 2 * cos.numel() * 4 + m * g * r * 2
    flop = 2 * m * g * r * (h * d // g)
    return (lambda: grouped_wo_a.grouped_wo_a(*args)), (lambda: grouped_wo_a.grouped_wo_a_ref(*args)), n_bytes, flop


def norm_rope_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of a norm or RoPE for M rows, bf16: `rms_norm` the
    weighted hidden norm [M, D] (attn_norm / ffn_norm), `rms_norm_q` V4's unweighted per-head q norm
    [M, H, d], `rope_q` the rotation of q [M, H, d] by [M, 1, rd/2] tables. Bytes: inputs read once
    (tables fp32), the output written once; no GEMM FLOP."""
    from dspark.kernels import rms_norm, rope

    gen = torch.Generator(device=device).manual_seed(m)
    if op == "rope_q":
        x = torch.randn(m, shape.n_heads, shape.head_dim, generator=gen, device=device).bfloat16()
        angles = torch.randint(0, CONTEXT, (m, 1, 1), generator=gen, device=device) * \
            torch.rand(shape.rope_dim // 2, generator=gen, device=device)
        args = (x, angles.cos(), angles.sin())
        n_bytes = 2 * x.numel() * 2 + 2 * angles.numel() * 4  # q in and out, cos and sin
        return (lambda: rope.rope(*args)), (lambda: rope.rope_ref(*args)), n_bytes, 0
    rows = (m, shape.dim) if op == "rms_norm" else (m, shape.n_heads, shape.head_dim)
    x = torch.randn(rows, generator=gen, device=device).bfloat16()
    weight = torch.rand(shape.dim, generator=gen, device=device) + 0.5 if op == "rms_norm" else None
    kw = dict(eps=1e-6, out_dtype=torch.bfloat16)
    n_bytes = 2 * x.numel() * 2 + (0 if weight is None else weight.numel() * 4)
    return (lambda: rms_norm.rms_norm(x, weight, **kw)), (lambda: rms_norm.rms_norm_ref(x, weight, **kw)), n_bytes, 0


def projection_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of a dense projection for M rows, bf16: `linear_wkv` the
    attention's kv projection [d, D] (`linear`: the one-row GEMV where it pays, torch's matmul
    otherwise, so above one row the two sides are the same call), `compressor_project` the CSA
    compressor's wkv and wgate [2·d, D] each plus its ape bias (one launch for one row where the GEMV
    pays). Bytes: the weights, x, and the outputs once."""
    from dspark.kernels import linear

    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, shape.dim, generator=gen, device=device).bfloat16()
    width = shape.head_dim if op == "linear_wkv" else 2 * shape.head_dim
    w = lambda: (torch.randn(width, shape.dim, generator=gen, device=device) * shape.dim ** -0.5).bfloat16()  # noqa: E731
    if op == "linear_wkv":
        weight = w()
        n_bytes = weight.numel() * 2 + x.numel() * 2 + m * width * 2
        return (lambda: linear.linear(x, weight)), (lambda: linear.linear_ref(x, weight)), n_bytes, \
            2 * m * width * shape.dim
    wkv, wgate = w(), w()
    ape = torch.randn(CSA_RATE, width, generator=gen, device=device)
    phase = torch.randint(0, CSA_RATE, (m,), generator=gen, device=device)
    args = (x, wkv, wgate, ape, phase)
    n_bytes = 2 * wkv.numel() * 2 + x.numel() * 2 + m * width * (2 + 4) + ape.numel() * 4
    return (lambda: linear.compressor_project(*args)), (lambda: linear.compressor_project_ref(*args)), n_bytes, \
        4 * m * width * shape.dim


def index_scores_case(op: str, shape: LayerShape, layer: dict, m: int, device: str):
    """(fused thunk, ref thunk, bytes, flop) of the static step's batched indexer scores: M slots, one
    decode row each, every slot's own T = 8192 index keys (a 32K context), all visible. Bytes: keys,
    q and weights read once, scores [M, 1, T] fp32 written once."""
    from dspark.kernels import indexer, indexer_ref

    gen = torch.Generator(device=device).manual_seed(m)
    n_keys, heads = CONTEXT // CSA_RATE, shape.index_heads
    q = torch.randn(m, 1, heads, INDEX_DIM, generator=gen, device=device).bfloat16()
    weights = torch.randn(m, 1, heads, generator=gen, device=device) * (heads * INDEX_DIM) ** -0.5
    keys = torch.randn(m, n_keys, INDEX_DIM, generator=gen, device=device).bfloat16()
    visible = torch.full((m, 1), n_keys, device=device)
    args = (q, weights, keys, visible)
    n_bytes = (keys.numel() + q.numel()) * 2 + weights.numel() * 4 + m * n_keys * 4
    return (lambda: indexer.index_scores(*args)), (lambda: indexer_ref.index_scores_ref(*args)), n_bytes, \
        2 * m * heads * n_keys * INDEX_DIM


def rel_err(out, ref) -> float:
    """max over the float outputs of ‖out − ref‖ / ‖ref‖ on the reference's finite entries (the
    indexer's scores hold −inf on masked entries; they must be −inf in both), inf on a mismatch;
    bool outputs (masks) count 0 when equal, inf otherwise; other integer outputs are not compared."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    errs = []
    for a, b in zip(outs, refs):
        if a.dtype == torch.bool:  # a mask (the candidate pool): exact, or a mismatch
            errs.append(0.0 if torch.equal(a, b) else float("inf"))
            continue
        if not a.is_floating_point():
            continue
        finite = b.isfinite()
        if not torch.equal(a.isfinite(), finite):
            return float("inf")
        a, b = a[finite].double(), b[finite].double()
        errs.append(((a - b).norm() / b.norm()).item())
    return max(errs)


def cuda_timer(args: argparse.Namespace):
    """Median seconds of fn() by CUDA events, L2 flushed before each run (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median") * 1e-3


def slow_timer(args: argparse.Namespace, max_runs: int = 20):
    """Median seconds of fn() over as many runs as fit in --rep-ms (1 to max_runs), by CUDA events.

    For the references: some take ~1 s per call at prefill sizes (FP8 dequantisation of every
    expert), where do_bench's fixed estimate-and-warmup runs alone would cost many seconds."""

    def time_it(fn):
        fn()  # warm
        times, spent = [], 0.0
        while len(times) < max_runs and (not times or spent < args.rep_ms * 1e-3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
            spent += times[-1]
        return sorted(times)[len(times) // 2]

    return time_it


def run_case(shape: LayerShape, op: str, m: int, layer: dict, timer, ref_timer, device: str = "cuda") -> dict:
    """Check and time one case; `timer(fn)` / `ref_timer(fn)` return seconds."""
    make = projection_case if op in ("linear_wkv", "compressor_project") else index_scores_case if op == "index_scores" \
        else norm_rope_case if op.startswith(("rms_norm", "rope")) else wo_a_case if op == "grouped_wo_a" else mhc_v41_case if op.startswith("mhc_v41") else mhc_case if op.startswith("mhc") else \
        attention_case if op.startswith("attn") else pool_case if op == "indexer_pool" else \
        indexer_case if op.startswith("indexer") else compressor_case if op.startswith("compressor") else moe_case
    fused, ref, n_bytes, flop = make(op, shape, layer, m, device)
    err = rel_err(fused(), ref())  # also compiles the kernels before timing
    t_fused, t_ref = timer(fused), ref_timer(ref)
    return {"layer": shape.name, "op": op, "M": m, "fused_us": t_fused * 1e6, "ref_us": t_ref * 1e6,
            "speedup": t_ref / t_fused, "rel_err": err, "bytes": n_bytes, "flop": flop,
            "GBps": n_bytes / t_fused / 1e9, "TFLOPs": flop / t_fused / 1e12,
            "pct_hbm": 100 * n_bytes / t_fused / HBM_BYTES_PER_S,
            "pct_bf16": 100 * flop / t_fused / BF16_FLOP_PER_S}


def model_config_path() -> Path | None:
    path = REPO / MODEL_CONFIG
    return path if path.is_file() else None


def model_case(args: argparse.Namespace, prompt_len: int = 512, batch: int = 1) -> list[dict]:
    """Whole-model step time of the v4-mini config (random bf16 weights), fused vs reference kernels:
    one prefill of `prompt_len` tokens per request, then --model-steps greedy decode steps of
    `batch` requests; median step time by CUDA events, and the logits' agreement."""
    from dspark.api import init_model
    from dspark.kernels import KernelConfig

    path = model_config_path()
    if path is None or args.model_steps <= 0:
        return []
    config = json.loads(path.read_text())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, config["vocab_size"], (batch * prompt_len,), generator=gen).cuda()
    rows, timings = [], {}
    for impl in ("triton", "ref"):
        model = init_model(config, seed=0, device="cuda", dtype=torch.bfloat16, kernels=KernelConfig.uniform(impl))
        for warm in (True, False):  # the first pass compiles the kernels of every shape class
            states = [model.new_state() for _ in range(batch)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(prompt, states, [prompt_len] * batch)
            end.record()
            end.synchronize()
            prefill_s, steps, logits = start.elapsed_time(end) * 1e-3, [], [out.logits[prompt_len - 1::prompt_len]]
            for _ in range(args.model_steps):
                nxt = logits[-1].argmax(-1) if impl == "triton" else timings["triton"]["tokens"][len(steps)]
                start.record()
                out = model(nxt, states, [1] * batch)
                end.record()
                end.synchronize()
                steps.append(start.elapsed_time(end) * 1e-3)
                logits.append(out.logits)
        tokens = [lg.argmax(-1) for lg in logits[:-1]] if impl == "triton" else None
        timings[impl] = {"prefill_s": prefill_s, "step_s": sorted(steps)[len(steps) // 2], "logits": logits,
                         "tokens": tokens}
        del model, states, out
        torch.cuda.empty_cache()
    fused, ref = timings["triton"], timings["ref"]
    # Both runs decode the fused run's greedy tokens, so every step's logits are comparable.
    errs = [rel_err(a.float(), b.float()) for a, b in zip(fused["logits"], ref["logits"])]
    for op, key, m in (("model_prefill", "prefill_s", batch * prompt_len), ("model_decode", "step_s", batch)):
        rows.append({"layer": "v4-mini-model", "op": op, "M": m, "fused_us": fused[key] * 1e6,
                     "ref_us": ref[key] * 1e6, "speedup": ref[key] / fused[key], "rel_err": max(errs),
                     "bytes": 0, "flop": 0, "GBps": 0.0, "TFLOPs": 0.0, "pct_hbm": 0.0, "pct_bf16": 0.0})
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'layer':<14}{'op':<19}{'M':>5}{'fused us':>10}{'ref us':>10}{'x':>7}{'GB/s':>8}{'%HBM':>6}" \
           f"{'TFLOP/s':>9}{'%bf16':>6}{'rel err':>9}"
    print(head)
    for r in rows:
        print(f"{r['layer']:<14}{r['op']:<19}{r['M']:>5}{r['fused_us']:>10.1f}{r['ref_us']:>10.1f}"
              f"{r['speedup']:>7.1f}{r['GBps']:>8.0f}{r['pct_hbm']:>6.1f}{r['TFLOPs']:>9.1f}{r['pct_bf16']:>6.1f}"
              f"{r['rel_err']:>9.1e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = plan(args)
    if args.dry_run:
        for shape, op, m in cases:
            print(f"{shape.name:<14}{op:<19}M={m}")
        return 0
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 2
    cond = conditions(args.commit or git_commit())
    cond.update(graph=args.graph, flush=args.flush if args.graph else "write (triton.testing.do_bench)")
    print(json.dumps(cond, indent=1), flush=True)
    rows, layers, start = [], {}, time.time()
    timer, ref_timer = cuda_timer(args), slow_timer(args)
    if args.graph:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from bench.attn_batched import graph_timer

        timer = functools.partial(graph_timer, flush=args.flush)
    for shape, op, m in cases:
        if shape.name not in layers:
            layers.clear()  # one layer's weights on the GPU at a time
            torch.cuda.empty_cache()
            layers[shape.name] = build_layer(shape, "cuda")
        rows.append(run_case(shape, op, m, layers[shape.name], timer, ref_timer))
        r = rows[-1]
        print(f"[{time.time() - start:6.1f}s] {r['layer']} {op} M={m}: {r['fused_us']:.1f} us "
              f"({r['speedup']:.1f}x ref, {r['pct_hbm']:.0f}% HBM, rel err {r['rel_err']:.1e})", flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    for batch in (1, 8):
        rows.extend(model_case(args, batch=batch))
    if rows and rows[-1]["op"].startswith("model"):
        print(f"[{time.time() - start:6.1f}s] whole-model cases done", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "args": vars(args), "results": rows}, indent=1))
    print_table(rows)
    print(f"wrote {out} ({len(rows)} cases, {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
