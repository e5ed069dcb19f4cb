"""Second-round training of dspark-tiny's DSpark drafter on the target's own continuations.

    # here (CPU): prompts cut from the corpus splits (tiny-data/corpus, dspark.tiny.corpus)
    python bench/tiny_drafter.py prompts --out tiny-data/v2
    # device tool: bash bench/tiny_drafter.sh gen, then bash bench/tiny_drafter.sh train
    #   (self-distilled continuations; several recipes at once, then τ per recipe)

`prompts` draws training prompts from the *train* split and evaluation and calibration prompts from
the *held-out* split, so the τ this script reports is on text neither model saw. `gen` decodes the
training prompts with the frozen target (greedy, and every `--sample-every`-th batch at T = 1: spec
§5.1 regenerates responses with the target). `train` continues a drafter (`--init-from`) with one
recipe under a wall-clock budget (the step count is set from a timed probe step, so the cosine
schedule ends on time). `eval` decodes the held-out prompts with given drafters and reports τ per
domain, temperature and budget; `ship` stores a drafter's matrices in bf16, as shipped.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import dspark
from dspark.draft.io import load_drafter
from dspark.request import summed_counts
from dspark.train.anchors import build_blocks, sample_anchors
from dspark.train.data import TrainingSequence
from dspark.train.losses import LossWeights
from dspark.train.trainer import TrainConfig, _prepare, block_losses, target_pass, train_draft

SHIPPED = "dspark/assets/dspark-tiny/drafter"
RECIPES = {  # name: (loss weights CE/TV/conf, learning rate)
    "paper": ((0.1, 0.9, 1.0), 6e-4),
    "ce": ((0.5, 0.5, 1.0), 6e-4),
    "ce-lr": ((0.5, 0.5, 1.0), 1.5e-3),
}


# ----------------------------------------------------------------------------------------------
# prompts (CPU)
# ----------------------------------------------------------------------------------------------


def _cut(text: str, rng: random.Random, min_chars: int, max_chars: int) -> str:
    """A prompt: a random line start of `text`, min..max characters, ending at a line end."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text)]
    start = rng.choice(starts[: max(1, len(starts) - 8)])
    piece = text[start:start + rng.randint(min_chars, max_chars)]
    return piece[: piece.rfind("\n") + 1] or piece


def prompts(args) -> None:
    rng = random.Random(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # calib: more held-out prompts (same documents, other cuts) for STS calibration, kept apart
    # from the evaluation prompts; drawn last so the other two files do not change.
    for split, counts in (("train", {"code": args.train_code, "prose": args.train_prose}),
                          ("heldout", {"code": args.eval_n, "prose": args.eval_n}),
                          ("calib", {"code": args.calib_n, "prose": args.calib_n})):
        rows = []
        seen = set()
        if split == "calib":
            seen = {json.loads(line)["prompt"] for line in open(out / "prompts.heldout.jsonl")}
        for domain, n in counts.items():
            source = "heldout" if split == "calib" else split
            docs = [json.loads(line)["text"] for line in open(f"{args.corpus}/{domain}.{source}.jsonl")]
            docs = [d for d in docs if len(d) > 2000]
            while len([r for r in rows if r["domain"] == domain]) < n:
                text = _cut(rng.choice(docs), rng, 120, 480)
                if len(text) >= 60 and text not in seen:
                    rows.append({"prompt": text, "domain": domain})
        with open(out / f"prompts.{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{split}: {len(rows)} prompts -> {out}/prompts.{split}.jsonl")


# ----------------------------------------------------------------------------------------------
# gen / train / eval (GPU)
# ----------------------------------------------------------------------------------------------


def _target(device: str):
    torch.manual_seed(0)
    return dspark.load_model("tiny", device=device, dtype=torch.float32)


def gen(args) -> None:
    model = _target(args.device)
    rows = [json.loads(line) for line in open(args.prompts)]
    random.Random(1).shuffle(rows)
    t0, written = time.perf_counter(), 0
    with open(args.out, "w") as f:
        for i in range(0, len(rows), args.batch):
            if time.perf_counter() - t0 > args.seconds:
                break
            chunk = rows[i:i + args.batch]
            temperature = 1.0 if (i // args.batch) % args.sample_every == args.sample_every - 1 else 0.0
            ids = [model.tokenizer.encode(r["prompt"]) for r in chunk]
            outs = dspark.generate(model, ids, max_new_tokens=args.new_tokens, temperature=temperature, seed=i)
            for p, o, r in zip(ids, outs, chunk):
                f.write(json.dumps({"input_ids": p + o.token_ids, "loss_mask": [0] * len(p) + [1] * len(o.token_ids),
                                    "domain": r["domain"], "temperature": temperature}) + "\n")
                written += 1
            print(f"gen: {written} sequences, T={temperature}, {time.perf_counter() - t0:.0f} s", flush=True)


def _load_data(path: str) -> list[TrainingSequence]:
    records = [json.loads(line) for line in open(path)]
    return [TrainingSequence(tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in records]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _probe_step_seconds(drafter, data, config: TrainConfig) -> tuple[float, float]:
    """(seconds of one target pass over a step's sequences, seconds of one drafter forward + backward
    over them), at the run's batch shape; no update."""
    prepared = _prepare(data[: config.batch_size], config.max_length)
    g = torch.Generator().manual_seed(0)
    noise = drafter.config.dspark_noise_token_id
    drafter.model.train().requires_grad_(True)
    seqs = [i for i, _ in prepared]
    t_target, t_draft = [], []
    for _ in range(3):
        _sync()
        t = time.perf_counter()
        known = target_pass(drafter.target, seqs, drafter.capture_layers)
        _sync()
        t_target.append(time.perf_counter() - t)
        blocks = [build_blocks(i, m, sample_anchors(m, config.num_anchors, g), drafter.block_size, noise)
                  for i, m in prepared]
        norm = float(sum(b.weights.sum() for b in blocks))
        loss, _ = block_losses(drafter, seqs, blocks, config.loss_weights, norm, known)
        loss.backward()
        _sync()
        t_draft.append(time.perf_counter() - t - t_target[-1])
    drafter.model.zero_grad(set_to_none=True)
    return min(t_target[1:]), min(t_draft[1:]) * 1.1  # optimizer step and bookkeeping on top


def train(args) -> None:
    target = _target(args.device)
    weights, lr = RECIPES[args.recipe]
    data = _load_data(args.data)
    drafter = load_drafter(args.init_from, target, dtype=torch.float32)
    base = dict(batch_size=args.batch_size, micro_batch=args.batch_size, num_anchors=args.num_anchors,
                lr=lr, warmup_ratio=0.03, loss_weights=LossWeights(*weights), max_length=1024,
                seed=args.seed, progress=False, cache_target=True)
    t_target, per_step = _probe_step_seconds(drafter, data, TrainConfig(steps=1, **base))
    first_epoch = t_target * len(data) / args.batch_size  # the target runs once per sequence (cache)
    steps = max(10, int((args.seconds - first_epoch) / per_step))
    print(f"train {args.recipe}: {len(data)} sequences, target {t_target:.3f} s + drafter {per_step:.3f} s "
          f"a step -> {steps} steps", flush=True)
    t = time.perf_counter()
    result = train_draft(target, data, TrainConfig(steps=steps, **base), drafter=drafter, out_dir=args.out)
    last = result.history[-20:]
    summary = {"recipe": args.recipe, "loss_weights": weights, "data": args.data, "sequences": len(data),
               "steps": steps, "seconds": time.perf_counter() - t, "batch_size": args.batch_size,
               "num_anchors": args.num_anchors, "lr": lr, "init_from": args.init_from,
               "final": {k: sum(m[k] for m in last) / len(last) for k in ("loss", "ce", "tv", "accept", "tau")}}
    Path(args.out, "train-summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)


def _tau(outs) -> float:
    return sum(o.stats.new_tokens - 1 for o in outs) / max(1, sum(o.stats.rounds for o in outs))


def evaluate(args) -> None:
    model = _target(args.device)
    rows = [json.loads(line) for line in open(args.prompts)]
    result = {"conditions": {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                             "dtype": "float32", "max_new_tokens": args.new_tokens, "prompts": args.prompts},
              "drafters": {}}
    for path in args.drafters:
        drafter = load_drafter(path, model)
        runs = []
        for temperature in (0.0, 1.0):
            for domain in ("code", "prose"):
                ids = [model.tokenizer.encode(r["prompt"]) for r in rows if r["domain"] == domain]
                for budget in range(1, 6):
                    outs = dspark.generate(model, ids, max_new_tokens=args.new_tokens, temperature=temperature,
                                           seed=0, draft_tokens=budget, drafter=drafter)
                    runs.append({"domain": domain, "temperature": temperature, "budget": budget, "tau": _tau(outs),
                                 "position_accepts": summed_counts([o.stats.position_accepts for o in outs])})
                    print(path, runs[-1], flush=True)
        result["drafters"][path] = runs
    Path(args.out).write_text(json.dumps(result, indent=2))


def ship(args) -> None:
    """Rewrite drafter directories as shipped: matrices (≥ 2 dims) in bf16, vectors kept in fp32;
    checkpoints the trainer saved along the way are dropped."""
    from safetensors.torch import load_file, save_file
    for path in map(Path, args.drafters):
        tensors = load_file(path / "model.safetensors")
        small = {k: (v.bfloat16() if v.is_floating_point() and v.dim() >= 2 else v) for k, v in tensors.items()}
        save_file(small, str(path / "model.safetensors"), metadata={"format": "pt"})
        for ckpt in path.glob("checkpoint-*"):
            for f in ckpt.iterdir():
                f.unlink()
            ckpt.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--corpus", default="tiny-data/corpus")
    p.add_argument("--out", default="tiny-data/v2")
    p.add_argument("--train-code", type=int, default=1536)
    p.add_argument("--train-prose", type=int, default=768)
    p.add_argument("--eval-n", type=int, default=24)
    p.add_argument("--calib-n", type=int, default=16)
    g = sub.add_parser("gen")
    g.add_argument("--prompts", default="tiny-data/v2/prompts.train.jsonl")
    g.add_argument("--out", required=True)
    g.add_argument("--batch", type=int, default=384)
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--sample-every", type=int, default=3, help="every Nth batch decodes at T = 1")
    g.add_argument("--seconds", type=float, default=150)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--recipe", choices=sorted(RECIPES), default="paper")
    t.add_argument("--init-from", default=SHIPPED)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--num-anchors", type=int, default=128)
    t.add_argument("--seconds", type=float, default=240)
    t.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("eval")
    e.add_argument("--prompts", default="tiny-data/v2/prompts.heldout.jsonl")
    e.add_argument("--drafters", nargs="+", required=True)
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--out", required=True)
    s_ = sub.add_parser("ship")
    s_.add_argument("drafters", nargs="+")
    for s in (g, t, e):
        s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    {"prompts": prompts, "gen": gen, "train": train, "eval": evaluate, "ship": ship}[args.cmd](args)


if __name__ == "__main__":
    main()
