"""How far tiny-v41's prefill logits move under tiny weight perturbations, with and without the KV
cache's QAT rounding (CPU, fp32, a few seconds).

    python bench/v41_qat_sensitivity.py --out bench/results/v41-qat-sensitivity-cpu.json

Why: on two H200s tiny-v41 under ep / tp / DEP differed from one process by up to 1.98 in logits
while tiny V4 agreed to 3.4e-6 (bench/README.md, two H200s). A layout changes only the fp32
summation order (~1e-6 relative); this script shows what such a change does to each variant: every
weight is multiplied by (1 + ε·N(0, 1)) for ε ∈ {1e-6, 1e-5, 1e-4} (seeded), and the max |Δ logit| of
a 33-token ragged prefill against the unperturbed model is recorded. With `cache_qat` (the default)
a cached value that moves across an FP8 rounding boundary jumps a whole FP8 step, so small
perturbations give O(1) changes; without it the change stays proportional to ε.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark.api import init_model

PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9]
NOISE = (1e-6, 1e-5, 1e-4)


def prefill_logits(noise: float, cache_qat: bool) -> torch.Tensor:
    model = init_model("tiny-v41", seed=0, prefill_mode="exact", cache_qat=cache_qat)
    if noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + noise * torch.randn(p.shape, generator=g))
    states = [model.new_state() for _ in PROMPTS]
    with torch.no_grad():
        return model(torch.tensor(sum(PROMPTS, [])), states, [len(p) for p in PROMPTS]).logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/v41-qat-sensitivity-cpu.json")
    args = ap.parse_args()
    rows = []
    for cache_qat in (True, False):
        ref = prefill_logits(0.0, cache_qat)
        for noise in NOISE:
            diff = (prefill_logits(noise, cache_qat) - ref).abs().max().item()
            rows.append({"cache_qat": cache_qat, "weight_noise": noise, "max_abs_logit_diff": diff})
            print(json.dumps(rows[-1]), flush=True)
    out = {"model": "tiny-v41, fp32, seed 0, prefill_mode exact", "device": "cpu", "torch": torch.__version__,
           "prompt_tokens": sum(map(len, PROMPTS)), "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
