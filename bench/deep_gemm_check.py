"""The deep_gemm path on a GPU without deep_gemm: its fallback and its torch plumbing on CUDA tensors.

    PYTHONPATH=. python bench/deep_gemm_check.py --out $OUT/deep-gemm-check-h200.json   # one H200, < 2 min

No deep_gemm build works on the H200 image, so this checks what can be checked there:

* `available`: what the capability check reports on this machine (expected: deep_gemm does not import);
* `fallback` rows: ``KernelConfig(linear="deep_gemm")`` / ``(fused_moe="triton", moe_experts="deep_gemm")``
  ops on CUDA equal the Triton ops bit for bit (v4-mini sizes: 1 and 64 rows of a 2048 -> 4096 linear;
  MoE of 2048 hidden, 64 experts × 512, top-6, FP8 128×128 weights, at 1 and 256 tokens) and name the reason;
* `double` rows: the W8A8 wrappers on CUDA tensors through the CPU test double of the deep_gemm contract
  (tests/kernels/deep_gemm_double.py, which runs on any device): layouts accepted, result against the
  W8A8 torch reference (`max_rel`) and the bf16 / weights-only result (`rel_vs_bf16`);
* `quantize_us`: eager time of the per-token activation quantisation (torch ops, not fused) at 1, 64, 4096 rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests" / "kernels"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import deep_gemm_double  # noqa: E402
from dspark.kernels import KernelConfig, get_op  # noqa: E402
from dspark.kernels import deep_gemm_path as dg  # noqa: E402
from dspark.kernels import moe, moe_deep_gemm as mdg  # noqa: E402
from dspark.kernels.fp8 import FP8BlockWeight  # noqa: E402
from dspark.kernels.linear import linear  # noqa: E402

DIM, N_OUT, N_EXP, INTER, TOP_K, LIMIT = 2048, 4096, 64, 512, 6, 10.0


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _moe_args(g, n_tok):
    w = lambda *s: FP8BlockWeight.quantize(torch.randn(*s, generator=g, device="cuda") * s[-1] ** -0.5, 128)  # noqa: E731
    x = torch.randn(n_tok, DIM, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(N_EXP, generator=g, device="cuda")[:TOP_K] for _ in range(n_tok)]).int()
    weights = torch.rand(n_tok, TOP_K, generator=g, device="cuda") + 0.5
    return (x, weights, ids, w(N_EXP, INTER, DIM), w(N_EXP, DIM, INTER), w(N_EXP, INTER, DIM),
            w(INTER, DIM), w(DIM, INTER), w(INTER, DIM))


def fallback_rows(g) -> list[dict]:
    rows = []
    weight = (torch.randn(N_OUT, DIM, generator=g, device="cuda") * DIM**-0.5).bfloat16()
    op = get_op(KernelConfig(linear="deep_gemm"), "linear")
    for m in (1, 64):
        x = torch.randn(m, DIM, generator=g, device="cuda").bfloat16()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            equal = torch.equal(op(x, weight), linear(x, weight))
        rows.append(dict(case="fallback", op="linear", rows=m, equal=equal, reason=op.fallback_reason))
    op = get_op(KernelConfig(fused_moe="triton", moe_experts="deep_gemm"), "moe_experts")
    for n_tok in (1, 256):
        args = _moe_args(g, n_tok)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            equal = torch.equal(op(*args, swiglu_limit=LIMIT), moe.moe_experts(*args, swiglu_limit=LIMIT))
        rows.append(dict(case="fallback", op="moe_experts", tokens=n_tok, equal=equal, reason=op.fallback_reason))
    return rows


def double_rows(g) -> list[dict]:
    sys.modules["deep_gemm"] = deep_gemm_double.make()
    api = dg.load_api()
    weight = (torch.randn(N_OUT, DIM, generator=g, device="cuda") * DIM**-0.5).bfloat16()
    converted = dg.DeepGemmWeight.from_weight(weight)
    x = torch.randn(64, DIM, generator=g, device="cuda").bfloat16()
    y = dg.fp8_linear(api, x, converted)
    rows = [dict(case="double", op="linear", rows=64, max_rel=_rel(y, dg.w8a8_linear_ref(x, converted)),
                 rel_vs_bf16=_rel(y, x.float() @ weight.float().T))]
    args = _moe_args(g, 64)
    experts = mdg.DeepGemmExperts.from_weights(*args[3:])
    y = mdg.moe_experts_deep_gemm(api, *args[:3], experts, LIMIT)
    rows.append(dict(case="double", op="moe_experts", tokens=64,
                     max_rel=_rel(y, mdg.moe_experts_w8a8_ref(*args[:3], experts, LIMIT)),
                     rel_vs_bf16=_rel(y, moe.moe_experts_ref(*args, swiglu_limit=LIMIT)),
                     finite=bool(y.isfinite().all())))
    del sys.modules["deep_gemm"]
    return rows


def quantize_rows_us(g) -> list[dict]:
    rows = []
    for m in (1, 64, 4096):
        x = torch.randn(m, DIM, generator=g, device="cuda").bfloat16()
        for _ in range(3):
            dg.quantize_activations(x)
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dg.quantize_activations(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        rows.append(dict(case="quantize_us", rows=m, dim=DIM, us=sorted(times)[len(times) // 2]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    ok, reason = dg.available("cuda")
    head = dict(case="conditions", gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit.strip(),
                date=datetime.datetime.now().isoformat(timespec="seconds"), available=ok, reason=reason)
    print(json.dumps(head), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [head]
    for part in (fallback_rows, double_rows, quantize_rows_us):
        for row in part(g):
            print(json.dumps(row), flush=True)
            rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
