"""Where do the Triton and reference DSpark V4 stages part on a GPU? Call-by-call evidence.

`tests/kernels/test_draft_stage_kernels.py::test_v4_stages_on_triton_match_the_references` measured
a relative error of ~1e-2 between the two fp32 drafters on an H200, while every op's own test agrees
to 1e-4 there and the same drafters agree to 3e-7 under the CPU interpreter. This script drafts with
the Triton drafter once, records the inputs of every stage op call (`sparse_attention`, `grouped_wo_a`,
the mHC sites and the MoE), and replays each call with the op's reference in fp32 and in fp64
(ground truth): which side drifts, and on which call.

    python bench/draft_stage_diag.py --out $OUT/draft-stage-diag.json      # one GPU, < 1 min
    python bench/draft_stage_diag.py --out /tmp/diag.json                  # CPU: Triton interpreter

Found on one H200 (2026-11-30, `draft-stage-diag-h200-bf16.json`): the test's target came from
`init_model`, whose CUDA default dtype is bf16, so on the GPU the "fp32" comparison ran in bf16 (every
call's fp32 and fp64 references differ by ~1.6e-3, the bf16 input rounding). With the target in
fp32 (the test now says so; `--dtype float32`, `draft-stage-diag-h200-fp32.json`): drafter logits
4.1e-7, every op call <= 2.4e-7.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
import conftest  # noqa: E402,F401  (the interpreter's patches on CPU)
import test_draft_stage_kernels as stage_test  # noqa: E402

import dspark  # noqa: E402
from dspark.draft import DSparkConfig  # noqa: E402
from dspark.kernels import KernelConfig, get_op  # noqa: E402

REF = KernelConfig()
OP_NAMES = {"pre": "mhc_pre", "post_pre": "mhc_post_pre", "post": "mhc_post", "attend": "sparse_attention",
            "wo_a": "grouped_wo_a"}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def first_tensor(out):
    return out[-1] if isinstance(out, tuple) else out


def to64(x):
    return x.double() if torch.is_tensor(x) and x.is_floating_point() else x


def recorder(name, op, ref_op, rows):
    def call(*args, **kwargs):
        out = op(*args, **kwargs)
        ref = ref_op(*args, **kwargs)
        try:  # fp64 ground truth where the reference accepts it (mHC keeps its parameters fp32)
            t = first_tensor(ref_op(*[to64(a) for a in args], **{k: to64(v) for k, v in kwargs.items()}))
        except (ValueError, RuntimeError):
            t = None
        o, r = first_tensor(out), first_tensor(ref)
        rows.append(dict(op=name, shapes=[list(a.shape) for a in args if torch.is_tensor(a)],
                         dtypes=[str(a.dtype) for a in args if torch.is_tensor(a)],
                         contiguous=[a.is_contiguous() for a in args if torch.is_tensor(a)],
                         triton_vs_ref=rel(o, r), triton_vs_fp64=None if t is None else rel(o, t),
                         ref_vs_fp64=None if t is None else rel(r, t)))
        return out
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the drafters' dtype (the first GPU run used init_model's CUDA default, bf16)")
    args = parser.parse_args()
    device = stage_test.DEVICE
    dtype = getattr(torch, args.dtype)
    target = dspark.init_model(stage_test.tiny_config("tiny-v4.json"), seed=0, device=device, dtype=dtype,
                               kernels=REF)
    pair = stage_test.drafter_pair(target, DSparkConfig.for_target(target.config, dspark_markov_rank=32))
    rows: list[dict] = []
    for stage in pair[0].model.mtp:
        chosen = stage.stage_kernels.chosen
        wrapped = {field: recorder(OP_NAMES[field], getattr(chosen, field), get_op(REF, OP_NAMES[field]), rows)
                   for field in OP_NAMES}
        stage.stage_kernels.chosen = chosen._replace(**wrapped)
        moe = stage.ffn
        moe._experts_op = recorder("moe_experts", moe._experts_op, get_op(REF, "moe_experts"), rows)
        moe._route = recorder("moe_route", moe._route, get_op(REF, "moe_route"), rows)
    (fused, fused_prop), (ref, ref_prop) = stage_test.propose_both(pair, target)
    result = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)",
        torch=torch.__version__, dtype=args.dtype, fp32_matmul_precision=torch.get_float32_matmul_precision(),
        cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        drafter=dict(base=rel(fused.base, ref.base), hidden_pre=rel(fused.hidden_pre, ref.hidden_pre),
                     confidence=rel(fused_prop.confidence_logits, ref_prop.confidence_logits)),
        worst={name: max((r["triton_vs_ref"] for r in rows if r["op"] == name), default=None)
               for name in (*OP_NAMES.values(), "moe_experts", "moe_route")},
        calls=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("device", "drafter", "worst")}, indent=1))


if __name__ == "__main__":
    main()
