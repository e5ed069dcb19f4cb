"""Which fused op moves the whole model's logits: each op alone on Triton (the rest on the torch
references) against the all-reference model, on the GPU, for the tiny V4 and V4.1 configs.

    python bench/kernels_diag.py --out $OUT/kernels-diag.json

Prefill of two random prompts (13 and 6 tokens) then two greedy decode steps; reports the largest
absolute logit difference per op and dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from importlib import resources

import torch

from dspark.api import init_model
from dspark.kernels.registry import KernelConfig


def _config(name: str) -> dict:
    return json.loads(resources.files("dspark.configs").joinpath(name).read_text())


def _run(model, prompts, steps=2):
    states = [model.new_state() for _ in prompts]
    out = model(torch.cat(prompts).cuda(), states, [len(p) for p in prompts])
    last = out.logits[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1]
    logits = [last.float()]
    for _ in range(steps):
        nxt = last.argmax(-1)
        out = model(nxt, states, [1] * len(prompts))
        last = out.logits
        logits.append(last.float())
    return torch.stack(logits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, options in (("tiny-v4.json", {}), ("tiny-v41.json", dict(prefill_mode="exact", cache_qat=False))):
        config = _config(name)
        vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
        prompts = [torch.randint(0, vocab - 2, (n,), generator=g) for n in (13, 6)]
        for dtype in (torch.float32, torch.bfloat16):
            ref = _run(init_model(config, seed=0, device="cuda", dtype=dtype,
                                  kernels=KernelConfig.uniform("ref"), **options), prompts)
            for op in [f.name for f in dataclasses.fields(KernelConfig)] + ["all"]:
                kc = KernelConfig.uniform("triton") if op == "all" else KernelConfig(**{op: "triton"})
                try:
                    got = _run(init_model(config, seed=0, device="cuda", dtype=dtype, kernels=kc, **options), prompts)
                    diff = (got - ref).abs().max().item()
                    row = {"config": name, "dtype": str(dtype), "op": op, "max_abs_logit_diff": diff,
                           "logit_scale": ref.abs().max().item()}
                except Exception as e:  # report and go on: this is a diagnosis
                    row = {"config": name, "dtype": str(dtype), "op": op, "error": repr(e)[:300]}
                rows.append(row)
                print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
