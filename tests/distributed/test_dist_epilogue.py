"""The TP MoE epilogue (dspark/distributed/fused_allreduce.py) on the CPU.

* The reference (`moe_epilogue_ref`) over 2 gloo ranks equals, bit for bit, the unfused path
  written out as the single-device block computes it: all-reduce of the fp32 partials, one
  rounding per expert output, then `MoE.forward`'s own finalize (index_add over experts in
  ascending id, shared expert added last, one rounding).
* The fused kernel's finalize (`finalize_slots`, Triton interpreter) equals the reference given the
  same per-rank slots, bit for bit in fp32 and bf16 (the interpreter's fp32 -> bf16 cast truncates;
  the test makes it round to nearest even, as the GPU does).
* It compiles for sm_90 without register spills (ahead of time; the GPU test runs it for real).

The push over symmetric memory needs two GPUs: tests/distributed/test_dist_fused_gpu.py.
"""

import importlib
import json
import os
import subprocess
import sys
import textwrap
from importlib import resources

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated (on first use, or the reload below)
    if "dspark.distributed.epilogue_kernel" in sys.modules:
        importlib.reload(sys.modules["dspark.distributed.epilogue_kernel"])

from dspark.distributed import fused_allreduce  # noqa: E402
from dspark.kernels import triton_available  # noqa: E402
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def epilogue_inputs(n, k, dim, ranks, seed, n_experts=16):
    """Per-rank fp32 partials [t, N, K+1, D], weights [N, K] fp32, ids [N, K] (row 0 repeats an
    expert: ties keep slot order). Partials are scaled so that bf16 rounding of the sums matters."""
    g = torch.Generator().manual_seed(seed)
    partials = torch.randn(ranks, n, k + 1, dim, generator=g) * 3
    weights = torch.rand(n, k, generator=g) + 0.1
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])
    ids[0, -1] = ids[0, 0]
    return partials, weights, ids


def unfused(partial_sum, weights, ids, dtype):
    """The single-device block's finalize over the summed partials [N, K+1, D] (dspark MoE.forward)."""
    out = partial_sum.to(dtype)
    k = ids.shape[1]
    routed = torch.zeros(out.shape[0], out.shape[2], dtype=torch.float32)
    for e in sorted(set(ids.flatten().tolist())):
        token, slot = torch.where(ids == e)
        routed.index_add_(0, token, out[token, slot].float() * weights[token, slot].unsqueeze(-1))
    return (routed + out[:, k].float()).to(dtype)


def _gloo_rank(rank, port, out_dir):
    from dspark.api import init_model
    from dspark.distributed import ParallelConfig, init_distributed, parallelize, shutdown

    torch.set_num_threads(1)
    comm = init_distributed(ParallelConfig(2, rank, tp=2), f"tcp://127.0.0.1:{port}")
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 5, 16):
            partials, weights, ids = epilogue_inputs(n, 6, 40, 2, seed=n)
            got = fused_allreduce.moe_epilogue_ref(partials[rank].clone(), weights, ids, dtype, comm)
            results.append((got, unfused(partials[0] + partials[1], weights, ids, dtype)))
    model = init_model(json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()), seed=0)
    layers = parallelize(model, ParallelConfig(2, rank, tp=2), comm)  # tp_epilogue "auto"
    fallback = (fused_allreduce.fused_unsupported(comm), [layer.workspace for layer in layers])
    torch.save((results, fallback), f"{out_dir}/rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory, spawn_ranks):
    out = tmp_path_factory.mktemp("epilogue")
    return spawn_ranks(_gloo_rank, out)


def test_auto_epilogue_falls_back_to_the_reference_on_gloo(gloo_ranks):
    for _, (reason, workspaces) in gloo_ranks:
        assert reason == "rank 0: device cpu is not a CUDA device; rank 1: device cpu is not a CUDA device"
        assert workspaces and all(w is None for w in workspaces)


def test_reference_epilogue_equals_unfused_path_bitwise(gloo_ranks):
    ranks = [pairs for pairs, _ in gloo_ranks]
    for pairs in ranks:
        for got, want in pairs:
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*ranks))  # identical on both ranks


class _Summed:
    """Stands in for the process group of the reference: the partial it gets is already summed."""

    @staticmethod
    def all_reduce_sum(x):
        return x


@pytest.fixture
def nearest_even_bf16(monkeypatch):
    """Under the interpreter, fp32 -> bf16 casts round to nearest even (torch's rounding, the GPU's)."""
    if DEVICE == "cuda":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", cast_impl)


@needs_triton
@pytest.mark.usefixtures("nearest_even_bf16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, dim, ranks", [(1, 6, 40, 2), (5, 6, 600, 2), (3, 2, 64, 3)])
def test_fused_finalize_equals_reference(dtype, n, k, dim, ranks):
    partials, weights, ids = epilogue_inputs(n, k, dim, ranks, seed=dim + ranks)
    buffer = torch.full((ranks, n * (k + 1) + 3, dim), float("nan"))  # rank stride past the rows read
    buffer[:, :n * (k + 1)] = partials.reshape(ranks, -1, dim)
    slots = buffer[:, :n * (k + 1)].to(DEVICE)
    got = fused_allreduce.finalize_slots(slots, weights.to(DEVICE), ids.to(DEVICE), dtype).cpu()
    summed = partials[0].clone()
    for r in range(1, ranks):  # rank order, as the kernel sums
        summed += partials[r]
    want = fused_allreduce.moe_epilogue_ref(summed, weights, ids, dtype, _Summed())
    assert got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


COMPILE = textwrap.dedent("""
    import json, os, re, subprocess, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dspark.distributed import epilogue_kernel as k, fused_allreduce as f

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = []
    for ty in ("bf16", "fp32"):
        constexprs = {"K": 6, "K_PAD": 8, "RANKS": 2, "BLOCK_D": f.BLOCK_D}
        signature = {"slots_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "out_ptr": "*" + ty,
                     "dim": "i32", "rank_stride": "i32", **{c: "constexpr" for c in constexprs}}
        kernel = triton.compile(ASTSource(k.epilogue_kernel, signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
        path = "/tmp/_dspark_epilogue_%d.cubin" % os.getpid()
        with open(path, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        os.remove(path)
        stack = int(re.search(r"STACK:(\\d+)", usage).group(1))
        out.append({"out": ty, "stack": stack, "fma": "fma.rn.f32" in kernel.asm["ptx"]})
    print(json.dumps(out))
""")


@needs_triton
def test_fused_kernel_compiles_for_sm90_without_fma_or_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == [{"out": "bf16", "stack": 0, "fma": False}, {"out": "fp32", "stack": 0, "fma": False}]
