"""Programmatic dependent launch (PDL) of the decode-sized Triton kernels.

Every kernel of the modules below takes a trailing `PDL` constexpr and starts with
`pdl_prologue(PDL)`; every launch passes `PDL=pdl, launch_pdl=pdl` with `pdl = pdl_launch(device,
programs of the grid)`. The CPU tests check those contracts from the source and from recorded
launches (the Triton interpreter has no `gdc_*`, so on CPU the kernels run with PDL off); one test
AOT-compiles a kernel for sm_90 to see the instructions' order; the GPU test compares a chain of
decode-sized ops replayed from CUDA graphs with PDL on and off, bit for bit.
"""

import ast
import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark.kernels import (attention, attention_wide, cache_round, compressor, engram_gate, engram_rows, grouped_wo_a,
                            hc_head_norm, indexer, indexer_pool, linear, mhc, mhc_norm, mhc_v41, moe, moe_decode,
                            moe_decode_tma, moe_route_decode, norm_rope, rms_norm, rope, step_index, triton_available, triton_compat)

MODULES = (attention, attention_wide, cache_round, compressor, engram_gate, engram_rows, grouped_wo_a, hc_head_norm,
           indexer, indexer_pool, linear, mhc, mhc_norm, mhc_v41, moe,
           moe_decode, moe_decode_tma, moe_route_decode, norm_rope, rms_norm, rope, step_index)
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")


def _tree(module) -> ast.Module:
    return ast.parse(Path(module.__file__).read_text())


def _launches(tree: ast.Module):
    """(enclosing function, call) of every `kernel[grid](...)` launch."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                    yield fn, node


def _launched_kernels(module) -> set[str]:
    return {call.func.value.id for _, call in _launches(_tree(module))}


# ----------------------------------------------------------------------------------- host helper


def test_pdl_launch_is_off_on_cpu():
    for programs in (1, 8, 10_000):
        assert triton_compat.pdl_launch(torch.device("cpu"), programs) is False


def test_pdl_launch_needs_hopper_and_a_decode_sized_grid(monkeypatch):
    """On a cc >= 9 device: PDL up to 4 programs per SM, not above; never below cc 9 or when the
    module constant is off."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton_compat, "_pdl_device", lambda index: (True, 132))
    assert triton_compat.pdl_launch(cuda, 1) and triton_compat.pdl_launch(cuda, 4 * 132)
    assert not triton_compat.pdl_launch(cuda, 4 * 132 + 1)
    monkeypatch.setattr(triton_compat, "_pdl_device", lambda index: (False, 132))
    assert not triton_compat.pdl_launch(cuda, 1)
    monkeypatch.setattr(triton_compat, "_pdl_device", lambda index: (True, 132))
    monkeypatch.setattr(triton_compat, "PDL", False)
    assert not triton_compat.pdl_launch(cuda, 1)


def test_pdl_launch_early_takes_any_grid_size_on_hopper_only(monkeypatch):
    """`early` (a kernel whose first programs work before the wait) lifts the grid-size limit, nothing else."""
    cuda = torch.device("cuda", 0)
    assert triton_compat.pdl_launch(torch.device("cpu"), 1, early=True) is False
    monkeypatch.setattr(triton_compat, "_pdl_device", lambda index: (True, 132))
    assert triton_compat.pdl_launch(cuda, 10_000, early=True) and not triton_compat.pdl_launch(cuda, 10_000)
    monkeypatch.setattr(triton_compat, "_pdl_device", lambda index: (False, 132))
    assert not triton_compat.pdl_launch(cuda, 1, early=True)
    monkeypatch.setattr(triton_compat, "_pdl_device", lambda index: (True, 132))
    monkeypatch.setattr(triton_compat, "PDL", False)
    assert not triton_compat.pdl_launch(cuda, 1, early=True)


def test_early_programs_wait_before_they_store():
    """An `EARLY_LOADS` kernel's early programs skip the prologue's wait; the row helper they store through
    waits (`pdl_wait_if`) before its store. (`_tma_up_kernel`'s own ticket store is made by routed programs
    only, which waited in the prologue: a < N <= N·K. `_tma_fused_kernel`'s early items are gate/up items:
    after `_up_rows` they count themselves done with an atomic, and only down items, which waited, store y.)"""
    defs = {n.name: n for n in _tree(moe_decode_tma).body if isinstance(n, ast.FunctionDef)}
    assert set(EARLY_LOADS) == {"_tma_up_kernel", "_tma_fused_kernel"}
    kernel = [ast.unparse(stmt) for stmt in defs["_tma_up_kernel"].body]
    assert any(line.startswith("_up_rows(") and line.endswith("early, PDL)") for line in kernel)
    assert any("if (a < n_tok) & (n0 == 0):" in line for line in kernel)
    fused = ast.unparse(defs["_tma_fused_kernel"])
    up_branch = fused[fused.index("if item < n_up:"):fused.index("else:\n        block = ")]
    assert "early, PDL)" in up_branch and "tl.store(" not in up_branch
    assert fused.index("early = item < n_tok * up_blocks") < fused.index("pdl_prologue_unless(early, PDL)")
    rows = ast.unparse(defs["_up_rows"])
    assert 0 < rows.index("pdl_wait_if(early, PDL)") < rows.index("tl.store(")
    assert rows.count("tl.store(") == 1


def test_pdl_device_reads_capability_and_sms_once_per_index(monkeypatch):
    asked = []

    def props(index):
        asked.append(index)
        return SimpleNamespace(major={0: 9, 1: 8}[index], multi_processor_count=132 if index == 0 else 108)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    triton_compat._pdl_device.cache_clear()
    try:
        assert [triton_compat._pdl_device(i) for i in (0, 1, 0, 1)] == [(True, 132), (False, 108)] * 2
    finally:
        triton_compat._pdl_device.cache_clear()  # drop the fake devices' entries
    assert asked == [0, 1]


# ---------------------------------------------------------------------------------------- kernels


# Kernel helpers that run before the PDL wait, and why nothing they read can be a predecessor's output
# (the test below reads only each kernel's own body, so a helper it calls there is argued here).
BEFORE_WAIT = {
    "_prefetch_fn_share": "index arithmetic and an L2 prefetch of the mHC site's weights (fn), nothing else",
    "_next_item": "the one-launch experts' item counter: without EARLY it waits first (its own memset came right "
                  "before); with EARLY the counters were zeroed before the router's launches (fused_counters)",
}
# Kernels whose `early` programs load before the wait (`pdl_prologue_unless(early, PDL)`, launched with
# `pdl_launch(..., early)`), and why those loads read nothing the predecessor writes. They store only after
# `pdl_wait_if` (test_early_programs_wait_before_they_store).
# Kernels that may release their successor before they wait (`pdl_prologue_release(RELEASE_FIRST, PDL)`), and
# the successor's early programs they are for.
RELEASE_FIRST = {"_route_select_kernel": "the decode MoE's gate/up launch, whose EARLY shared rows then overlap the "
                                         "router's logits kernel too"}
EARLY_LOADS = {
    "_tma_up_kernel": "EARLY: the shared experts' rows load x and the shared weights; fused_moe passes x_ready "
                      "(the router, launched after x was written, is the predecessor)",
    "_tma_fused_kernel": "EARLY: the shared rows' gate/up items load x and the shared weights, as _tma_up_kernel's; "
                         "fused_moe and the MoE layer pass x_ready and counters made before the router",
}


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_kernel_takes_pdl_and_waits_before_touching_memory(module):
    names = _launched_kernels(module)
    assert names, f"no launches found in {module.__name__}"
    defs = {n.name: n for n in _tree(module).body if isinstance(n, ast.FunctionDef)}
    for name in names:
        kernel = getattr(module, name)
        params = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
        assert params[-1] == "PDL", f"{module.__name__}.{name} has no trailing PDL parameter: {params}"
        body = defs[name].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        lines = [ast.unparse(stmt) for stmt in body]
        prologue = "pdl_prologue_unless(early, PDL)" if name in EARLY_LOADS else \
            "pdl_prologue_release(RELEASE_FIRST, PDL)" if name in RELEASE_FIRST else "pdl_prologue(PDL)"
        assert prologue in lines, f"{module.__name__}.{name} has no top-level {prologue}"
        # Before the wait only index arithmetic and `pdl_prefetch` of weights: no load, store or atomic
        # may touch memory a predecessor could still be writing.
        before = "\n".join(lines[:lines.index(prologue)])
        for access in ("tl.load", "tl.store", "tl.atomic", "tl.make_tensor_descriptor"):
            assert access not in before, f"{module.__name__}.{name} runs {access} before pdl_prologue(PDL)"
        for helper in re.findall(r"\b(_\w+)\(", before):  # a module helper before the wait: its reads argued
            assert helper in BEFORE_WAIT, f"{module.__name__}.{name} calls {helper} before pdl_prologue(PDL)"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_launch_passes_the_pdl_launch_answer(module):
    """Each `kernel[grid](...)` passes PDL= and launch_pdl= the same name, bound to `pdl_launch(...)`
    in the launching function (a future kernel cannot forget either)."""
    for fn, call in _launches(_tree(module)):
        where = f"{module.__name__}.{fn.name} -> {call.func.value.id}"
        kwargs = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
        assert "launch_pdl" in kwargs and "PDL" in kwargs, f"{where} misses PDL= or launch_pdl="
        assert kwargs["launch_pdl"] == kwargs["PDL"], where
        bound = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "pdl_launch"
                 for t in node.targets if isinstance(t, ast.Name)}
        assert kwargs["PDL"] in bound, f"{where}: PDL={kwargs['PDL']} is not a pdl_launch(...) result"


class Recorder:
    """Stands in for a kernel: logs the grid and the PDL flags, then runs the kernel with PDL off
    (the interpreter has no gdc_*)."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("launch", self.name, math.prod(grid), kwargs["PDL"], kwargs["launch_pdl"]))
            return self.kernel[grid](*args, **dict(kwargs, PDL=False, launch_pdl=False))

        return launch


def _every_op(device: str) -> None:
    """Each fused op once on small inputs, together reaching every kernel of MODULES, most of them
    with more than one program (so that a launch asking for the wrong program count shows)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device, dtype)

    eps = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3)
    x, site = rand(5, 4, 128), (rand(24, 512) * 0.05, rand(24), torch.rand(3, generator=g).to(device) + 0.5)
    post, comb, u = mhc.mhc_pre(x, *site, **eps)
    mhc.mhc_post(u, x, post, comb)
    mhc.mhc_post_pre(u, x, post, comb, *site, **eps)
    mhc_v41.mhc_v41_pre(x, post, *site, torch.ones(128, device=device), **eps, norm_eps=1e-6)
    mhc.mhc_pre(x[:2], *site, **eps)  # the statistics split over the streams (a few tokens)
    mhc_v41.mhc_v41_post_pre(u[:2], x[:2], post[:2], comb[:2], post[:2], *site, torch.ones(128, device=device),
                             **eps, norm_eps=1e-6)  # V4.1 likewise, the post fused
    # 2 tokens: the folded epilogue (`mhc_norm.folds`) launches
    mhc_norm.mhc_pre_norm(x[:2], *site, torch.ones(128, device=device), **eps, norm_eps=1e-6)
    head = (rand(4, 512) * 0.05, rand(4), torch.rand(1, generator=g).to(device) + 0.5)
    hc_head_norm.hc_head_norm(x, *head, torch.ones(128, device=device), rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-6)
    rms_norm.rms_norm(rand(40, 128), torch.ones(128, device=device), eps=1e-6, out_dtype=torch.float32)
    angles = rand(4, 1, 8)
    rope.rope(rand(4, 16, 256), angles.cos(), angles.sin())
    norm_rope.norm_rope(rand(4, 16, 256), None, angles.cos(), angles.sin(), eps=1e-6,  # q heads, stored at rows
                        out=rand(70, 256), out_rows=torch.arange(64, device=device))
    cache_round.cache_round(rand(65, 64), fmt="fp8_ue8m0")
    engram_gate.engram_gate(rand(3, 4, 64), rand(3, 5 * 64), rand(4, 64), rand(4, 64), None, eps=1e-6)
    long = dict(dtype=torch.long, device=device)
    engram_rows.engram_rows(torch.randint(0, 9, (2, 2)).to(device), torch.tensor([[4, 5], [6, 7]], device=device),
                            torch.zeros(2, 5, **long), torch.arange(9, device=device), torch.ones(1, 4, **long),
                            torch.full((1, 3, 2), 7, **long), torch.zeros(1, 6, **long), pad_id=2, image_token_id=None)
    segments = step_index.SegmentTable.build([(step_index.ROW, 1, 1, 0, 0, 0, 0, 0),
                                              (step_index.KEYS, 1, 12, 11, 8, 4, 4, 40)], device)
    step_index.step_index(torch.tensor([3, 17], device=device), segments, tokens=2)
    index = torch.randint(-1, 40, (2, 70), generator=g).to(device)
    attention.sparse_attention(rand(2, 4, 64), rand(40, 64), index, torch.zeros(4, device=device), 0.125)
    attention.launch_sparse_attention(rand(2, 4, 64), rand(40, 64), index, torch.zeros(4, device=device), 0.125,
                                      attention.op_tiles(2, 4, 64), qnorm=(rand(2, 8), rand(2, 8), 1e-6))  # q norm fold
    attention.launch_sparse_attention(rand(2, 4, 64), rand(40, 64), index, torch.zeros(4, device=device), 0.125,
                                      attention.Tiles(16, 16, 4, wide=True, value_split=2))
    keys, visible = rand(100, 32), torch.tensor([99, 100], device=device)
    indexer.lightning_indexer(rand(2, 4, 32), rand(2, 4), keys, visible, None, topk=8)
    indexer.index_scores(rand(1, 2, 4, 32), rand(1, 2, 4), keys[None], visible[None])
    indexer_pool.indexer_pool(rand(2, 64), torch.tensor([30, 64], device=device), topk_blocks=2, block=8)
    for block in (8, 3):  # block maxima in the score kernel's epilogue; the scores, then `_block_max_kernel`
        indexer_pool.index_scores_pooled(rand(1, 2, 4, 32), rand(1, 2, 4), keys[None], visible[None], block=block)
    out, cs = rand(17, 8, 64), rand(17, 8)
    grouped_wo_a.launch_grouped_wo_a(out, cs, cs, rand(64, 256), grouped_wo_a.Tiles(16, 16, 16, 4, 2, 2))
    grouped_wo_a.launch_wo_a_gemv(out[:2], cs[:2], cs[:2], rand(64, 256))
    n_exp, dim, inter = 4, 32, 16
    experts = [rand(*s) / 4 for s in ((n_exp, inter, dim), (n_exp, dim, inter), (n_exp, inter, dim),
                                      (inter, dim), (dim, inter), (inter, dim))]
    router = (rand(40, dim), rand(n_exp, dim) / 4, torch.zeros(n_exp, device=device), None, None)
    route = dict(top_k=2, routed_scaling_factor=1.5, hash_routing=False)
    moe.fused_moe(*router, *experts, **route, swiglu_limit=10.0)  # decode router, packed experts
    moe.route_prefill(*router, **route)
    weights, ids = moe.moe_route(*router, **route)
    moe_decode.decode_experts(router[0][:1], weights[:1], ids[:1].int(), *experts, 10.0)  # TMA gate/up
    moe_decode.decode_experts(router[0][:1], weights[:1], ids[:1].int(), *experts, 10.0,
                              tiles=moe_decode.DecodeTiles())  # the GEMV gate/up kernel
    h, args = moe_decode.decode_up(router[0][:1], ids[:1].int(), *experts[0:3:2], *experts[3:6:2], 10.0,
                                   moe_decode.DecodeTiles(down_split=2))
    moe_decode_tma.tma_down(h, router[0][:1], weights[:1], ids[:1].int(), experts[1], experts[4], args,
                            moe_decode_tma.TmaTiles(16, 16, 4, 2), 2)  # the split TMA down kernel
    moe_decode_tma.tma_fused(router[0][:1], weights[:1], ids[:1].int(), *experts, 10.0,
                             moe_decode_tma.TmaTiles(16, 16, 4, 2), moe_decode_tma.TmaTiles(16, 16, 4, 2))  # one launch
    linear.launch_gemv(rand(3, 64), rand(40, 64))
    linear.launch_gemv(rand(1, 64), rand(40, 64), scale=0.5)  # `linear_scaled`'s epilogue
    linear.launch_gemv(rand(1, 64), rand(32, 64), rope=(rand(1, 4), rand(1, 4), 16))  # `linear_rope`'s epilogue
    ape, phase = rand(4, 24), torch.tensor([1, 3], device=device)
    linear.launch_project(rand(2, 64), rand(24, 64), rand(24, 64), ape, phase)
    linear.launch_project_fp32(rand(2, 64), rand(24, 64), rand(24, 64))  # V4.1's pair: no bias
    kv, score, norm_weight = rand(3, 8, 32), rand(3, 8, 32), torch.ones(32, device=device)
    for split in (True, False):  # channel blocks + norm launch, or one program per entry
        compressor.launch_compressor_pool(kv, score, norm_weight, eps=1e-6, out_dtype=torch.float32, split=split)


@needs_triton
def test_each_launch_asks_pdl_launch_for_its_own_grid(monkeypatch):
    """With `pdl_launch` answering True, every kernel of MODULES is launched with PDL=True and
    launch_pdl=True, right after one `pdl_launch` call for its device and its grid's program count."""
    log = []

    def pdl_launch(device, programs, early=False):
        log.append(("ask", device, programs))
        return True

    for module in MODULES:
        monkeypatch.setattr(module, "pdl_launch", pdl_launch)
        for name in _launched_kernels(module):
            monkeypatch.setattr(module, name, Recorder(getattr(module, name), name, log))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels on the CPU only
    _every_op(device)
    launches = [i for i, event in enumerate(log) if event[0] == "launch"]
    assert {log[i][1] for i in launches} == set().union(*map(_launched_kernels, MODULES))
    assert len(log) == 2 * len(launches)
    for i in launches:
        _, name, programs, pdl, launch_pdl = log[i]
        ask, asked_device, asked_programs = log[i - 1]
        assert (ask, asked_device.type, asked_programs) == ("ask", device, programs), (name, log[i - 1], programs)
        assert pdl is True and launch_pdl is True, name


@needs_triton
def test_pdl_prologue_calls_gdc_only_with_pdl():
    """Under the interpreter (no gdc_*) a kernel with PDL=False runs; PDL=True reaches gdc_wait."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("checks the interpreter's behaviour (CPU machines)")
    x = torch.zeros(64)
    cache_round._round_kernel[(1,)](x, torch.empty_like(x), x, 1, 1, BLOCK=64, ROWS=1, FMT=0, HAS_ROWS=False,
                                    PDL=False, launch_pdl=False)
    with pytest.raises(Exception, match="_semantic"):  # the interpreter cannot run griddepcontrol
        cache_round._round_kernel[(1,)](x, torch.empty_like(x), x, 1, 1, BLOCK=64, ROWS=1, FMT=0, HAS_ROWS=False,
                                        PDL=True, launch_pdl=True)


AOT = textwrap.dedent("""
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dspark.kernels import {module}

    fn = {module}.{kernel}
    types = {types!r}
    found = {{}}
    for flag in (False, True):
        constexprs = dict({constexprs!r}, {flag}=flag)
        signature = {{n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}}
        ptx = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                             options=dict(launch_pdl=constexprs["PDL"], num_warps={warps})).asm["ptx"]
        found[str(flag)] = [ptx.find(s) for s in {needles!r}]
    print(json.dumps(found))
""")


def _aot(module: str, kernel: str, types: dict, constexprs: dict, flag: str, needles: tuple, warps: int = 4) -> dict:
    """AOT-compile dspark.kernels.`module`.`kernel` for sm_90 with the constexpr `flag` False and True (the others
    `constexprs`; PDL among them or the flag) in a subprocess with the interpreter off: "False" / "True" -> where
    each of `needles` first appears in the PTX (-1: nowhere)."""
    script = AOT.format(module=module, kernel=kernel, types=types, constexprs=constexprs, flag=flag, needles=needles,
                        warps=warps)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
def test_sm90_code_waits_before_it_releases_and_reads():
    """AOT for sm_90 (no GPU needed): with PDL the wait precedes the release and the first global
    load; without PDL neither instruction is emitted."""
    found = _aot("rms_norm", "_rms_norm_kernel",
                 dict(x_ptr="*bf16", w_ptr="*fp32", y_ptr="*bf16", n_rows="i32", dim="i32", stride_x="i32", eps="fp32"),
                 dict(BLOCK_M=1, BLOCK_D=2048, ONE_TILE=True, HAS_WEIGHT=True), "PDL",
                 ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "ld.global"))
    wait, release, load = found["True"]
    assert 0 <= wait < release < load, found
    assert found["False"][:2] == [-1, -1] and found["False"][2] >= 0, found


@needs_triton
def test_sm90_router_select_releases_before_it_waits_with_release_first():
    """AOT for sm_90: RELEASE_FIRST puts the release before the wait (both before the first load); without it
    the usual order."""
    found = _aot("moe_route_decode", "_route_select_kernel",
                 dict(part_ptr="*fp32", bias_ptr="*fp32", tid2eid_ptr="*fp32", tok_ptr="*fp32", w_out_ptr="*fp32",
                      id_out_ptr="*i32", n_tok="i32", n_exp="i32", n_splits="i32", scaling="fp32"),
                 dict(TOP_K=6, K_PAD=8, E_PAD=256, S_PAD=16, HASH=False, BIAS_ROWS=False, PDL=True), "RELEASE_FIRST",
                 ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "ld.global"))
    release, wait, load = found["True"]
    assert 0 <= release < wait < load, found
    release, wait, load = found["False"]
    assert 0 <= wait < release and wait < load, found


@needs_triton
def test_sm90_code_prefetches_weights_before_the_wait():
    """AOT for sm_90: with PREFETCH the GEMV issues its L2 bulk prefetch before `griddepcontrol.wait`
    and loads nothing before it; without PREFETCH no prefetch is emitted."""
    found = _aot("linear", "_gemv_kernel",
                 dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", n_rows="i32", n_out="i32", n_in="i32", scale="fp32",
                      cos_ptr="*fp32", sin_ptr="*fp32", head_dim="i32", half="i32"),
                 dict(ROWS=4, BLOCK_N=8, BLOCK_K=1024, SCALED=False, ROPE=False, PDL=True), "PREFETCH",
                 ("cp.async.bulk.prefetch.L2.global", "griddepcontrol.wait", "ld.global"), warps=8)
    prefetch, wait, load = found["True"]
    assert 0 <= prefetch < wait < load, found
    assert found["False"][0] == -1 and 0 <= found["False"][1] < found["False"][2], found


def test_prefetch_launch_needs_pdl_the_switch_and_aligned_rows(monkeypatch):
    w = torch.empty(4, 64, dtype=torch.bfloat16)
    assert triton_compat.prefetch_launch(True, w) and not triton_compat.prefetch_launch(False, w)
    assert not triton_compat.prefetch_launch(True, w, w[:, 1:])  # a base 2 bytes past alignment
    assert not triton_compat.prefetch_launch(True, torch.empty(4, 7, dtype=torch.bfloat16))  # 14-byte rows
    monkeypatch.setattr(triton_compat, "PREFETCH", False)
    assert not triton_compat.prefetch_launch(True, w)


# ------------------------------------------------------------------------------------------- GPU


def _decode_chain():
    """bench/pdl_ops.py's chain of decode-sized ops (v4-mini sizes), each reading the previous output."""
    spec = importlib.util.spec_from_file_location("bench_pdl_ops", Path(__file__).resolve().parents[2] / "bench"
                                                  / "pdl_ops.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.decode_chain()


def _replay(step):
    """Capture step() once (after a warm-up that compiles), replay twice; the outputs of each replay."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append([t.clone() for t in outs])
    return replays


@pytest.mark.gpu
def test_decode_chain_with_pdl_equals_without(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability >= 9")
    assert triton_compat.pdl_launch(torch.device("cuda"), 1)
    with_pdl = _replay(_decode_chain())
    monkeypatch.setattr(triton_compat, "PDL", False)
    assert not triton_compat.pdl_launch(torch.device("cuda"), 1)
    without = _replay(_decode_chain())
    for replay in (*with_pdl, without[1]):
        for a, b in zip(replay, without[0]):
            assert torch.equal(a, b)
