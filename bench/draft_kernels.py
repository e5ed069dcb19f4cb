"""The DSpark drafter's stages on the kernel registry, on one GPU: fused (the target's `kernels`,
`KernelConfig.for_device("cuda")`) against the torch references, v4-mini target, random weights.

    PYTHONPATH=. python bench/draft_kernels.py --out $OUT/draft-kernels.json          # one H200, ~2-4 min
    PYTHONPATH=. python bench/draft_kernels.py --smoke --out /tmp/draft-kernels.json  # CPU, tiny-v4, refs only

Two drafters with equal random weights draft for one target: "fused" built with the target's kernel
choice, "ref" with `KernelConfig()`. Each request's draft state is the last W committed rows of a
real prompt (one target prefill of `--prompt` tokens; every request gets the same context, so only
the batch size varies). Per batch size B:

* accuracy: the block's base logits and confidence logits of the fused drafter against an fp32
  copy of the reference drafter (METHOD.md: compare with higher precision), next to the bf16
  reference drafter's own error against it; greedy slots that differ between fused and ref, with
  the fp32 top-2 margin at each;
* time: median `propose` latency (greedy, CUDA synchronised) of each drafter, `--steps` timed
  after `--warmup` untimed calls.

Training check: one `block_losses` + backward of the fused-configured drafter (autograd on: the
stages run the references) must give the reference drafter's loss and gradients exactly.
Writes one JSON file (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.dspark_v4 import DSparkModel
from dspark.kernels import KernelConfig
from dspark.train.anchors import build_blocks
from dspark.train.losses import LossWeights
from dspark.train.trainer import block_losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-v4, small grid (checks the script)")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args(argv)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_drafter(target, config, kernels, dtype, seed=4):
    model = DSparkModel(config, target.config, dtype=dtype, device=target.device, kernels=kernels)
    return DSparkDrafter(target, config, model.init_weights(seed).eval())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def draft_states(drafter, out, ids, batch):
    states = [drafter.new_state() for _ in range(batch)]
    for state in states:
        drafter.observe(state, ids, out.hidden, out.features)
    return states


@torch.no_grad()
def block(drafter, states, anchors):
    draft = drafter.block_logits(states, anchors).out
    proposal = drafter.propose(states, anchors, dspark.SamplingParams(temperature=0.0),
                               [torch.Generator(device=drafter.model.device) for _ in states])
    return draft, proposal


def time_propose(drafter, states, anchors, warmup, steps):
    params = dspark.SamplingParams(temperature=0.0)
    gens = [torch.Generator(device=drafter.model.device) for _ in states]
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            sync(drafter.model.device)
            start = time.perf_counter()
            drafter.propose(states, anchors, params, gens)
            sync(drafter.model.device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def training_check(target, config, fused_kernels, ids):
    """Loss and gradients of one step, fused-configured vs reference drafter (fp32 weights)."""
    blocks = build_blocks(ids.cpu(), torch.ones_like(ids.cpu()), torch.tensor([1, len(ids) // 2, len(ids) - config.dspark_block_size - 1]),
                          config.dspark_block_size, config.dspark_noise_token_id)
    results = []
    for kernels in (fused_kernels, KernelConfig()):
        drafter = make_drafter(target, config, kernels, torch.float32)
        drafter.model.train().requires_grad_(True)
        loss, _ = block_losses(drafter, ids, blocks, LossWeights(), float(blocks.weights.sum()))
        loss.backward()
        results.append((loss.detach(), [p.grad for p in drafter.model.parameters()]))
    (loss_f, grads_f), (loss_r, grads_r) = results
    same_grads = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                     for a, b in zip(grads_f, grads_r))
    return dict(loss_fused_config=float(loss_f), loss_ref=float(loss_r), loss_equal=bool(torch.equal(loss_f, loss_r)),
                grads_equal=same_grads)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name = "tiny-v4" if args.smoke else "v4-mini"
    prompt = min(args.prompt, 64) if args.smoke else args.prompt
    batches = [1, 4] if args.smoke else [int(b) for b in args.batches.split(",")]
    target = dspark.init_model(name, seed=0, device=device, dtype=dtype)
    config = DSparkConfig.for_target(target.config)
    fused_kernels = target.kernels
    ids = torch.randint(0, 256, (prompt,), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = target(ids, [target.new_state()], [prompt], capture_layers=tuple(config.dspark_target_layer_ids))
    drafters = {"fused": make_drafter(target, config, fused_kernels, dtype),
                "ref": make_drafter(target, config, KernelConfig(), dtype),
                "ref_fp32": make_drafter(target, config, KernelConfig(), torch.float32)}
    features32 = {i: f.float() for i, f in out.features.items()}
    report = dict(config=name, dtype=str(dtype), device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  kernels=fused_kernels.__dict__, prompt=prompt, gamma=config.dspark_block_size, rows=[])
    for batch in batches:
        anchors = ids[-batch:].tolist() if batch <= prompt else [int(ids[-1])] * batch
        results = {}
        for key, drafter in drafters.items():
            rows = out if key != "ref_fp32" else type(out)(out.logits, out.hidden.float(), features32)
            states = draft_states(drafter, rows, ids, batch)
            results[key] = (states, *block(drafter, states, anchors))
        (_, exact, exact_prop) = results["ref_fp32"]
        row = dict(batch=batch)
        for key in ("fused", "ref"):
            _, draft, prop = results[key]
            row[f"{key}_base_err_vs_fp32"] = rel_err(draft.base, exact.base)
            row[f"{key}_conf_err_vs_fp32"] = rel_err(prop.confidence_logits, exact_prop.confidence_logits)
            row[f"{key}_propose_s"] = time_propose(drafters[key], results[key][0], anchors, args.warmup, args.steps)
        split = results["fused"][2].tokens != results["ref"][2].tokens
        top2 = exact.base.topk(2, dim=-1).values
        row["greedy_splits"] = int(split.sum())
        row["split_fp32_margins"] = (top2[..., 0] - top2[..., 1])[split].tolist()
        row["speedup"] = row["ref_propose_s"] / row["fused_propose_s"]
        report["rows"].append(row)
        print(json.dumps(row))
    report["training"] = training_check(target, config, fused_kernels, ids)
    print(json.dumps(report["training"]))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
