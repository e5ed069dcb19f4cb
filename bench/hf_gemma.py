"""DSpark on a real transformers target (Gemma-3 270M): train a drafter, then the paper's Table-1 layout.

    python -m dspark.models.hf_causal.gguf --gemma --out models/gemma-3-270m        # once
    PYTHONPATH=. python bench/hf_gemma.py --model models/gemma-3-270m --out bench/results/hf-gemma-cpu.json

1. Training prompts: first text turns of the full prompt sets in `--train-dir` (default ../shared/data/eval)
   *minus* every prompt of the shipped evaluation subsets (dspark/data/eval, checked by exact text),
   `--train-prompts` per domain (math: gsm8k, code: mbpp, chat: arena-hard-v2).
2. Target cache: the target's greedy continuations of them (`--distill-tokens`), then `train_draft`
   (γ = 7, five stages, Markov rank `--markov-rank`) for `--steps`, then STS calibration at T = 1 on
   training prompts (never on evaluation prompts).
3. Evaluation at batch 1 on the shipped subsets (first `--limit` prompts of gsm8k, humaneval,
   mt-bench): τ and wall-clock decode speed of plain decoding, n-gram (γ = 7, all verified) and
   DSpark (all verified, and the confidence-scheduled "auto" budget), at T = 0 and T = 1.

Writes one JSON (conditions, training history summary, per (method, T, domain) τ, tokens, decode
seconds, speedup over plain). Keep `--threads 1` on shared CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import dspark
from dspark.draft import DSparkConfig, NgramDrafter
from dspark.evaluate import encode_prompt as encode_text
from dspark.evaluate import load_prompts
from dspark.train.calibrate import calibrate_sts
from dspark.train.data import self_distill
from dspark.train.trainer import TrainConfig, train_draft

EVAL_SETS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench"}
TRAIN_SETS = {"math": "gsm8k", "code": "mbpp", "chat": "arena-hard-v2"}


def encode_prompt(model, text: str) -> list[int]:
    """The evaluation encoding (chat template when the tokenizer has one), with the tokenizer's BOS
    first when it defines one: Gemma's base model degenerates without it."""
    ids = encode_text(model, text)
    bos = getattr(model.tokenizer, "bos_token_id", None)
    return ids if bos is None or ids[:1] == [bos] else [bos] + ids


def training_prompts(model, train_dir: Path, per_domain: int, max_tokens: int) -> list[list[int]]:
    """Prompts of the full sets that are not in any shipped evaluation subset, shortest-first capped."""
    held_out = {p for name in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "arena-hard-v2")
                for p in load_prompts(name)}
    out = []
    for name in TRAIN_SETS.values():
        texts = [t for t in _first_turns(train_dir / f"{name}.jsonl") if t not in held_out]
        ids = [encode_prompt(model, t) for t in texts[:4 * per_domain]]
        out += [p for p in ids if len(p) <= max_tokens][:per_domain]
    return out


def _first_turns(path: Path) -> list[str]:
    """First user turns of a full prompt set; lines whose first turn is not text are skipped."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            turns = json.loads(line).get("turns")
        except (json.JSONDecodeError, AttributeError):  # the full arena-hard file has broken lines
            continue
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            out.append(turns[0])
    return out


def measure(model, prompts: list[list[int]], temperature: float, max_new: int, drafter, budget, seed: int) -> dict:
    """Batch-1 decoding of every prompt; τ over all rounds and decode wall time."""
    new, rounds, decode_s = 0, 0, 0.0
    for i, prompt in enumerate(prompts):
        out = dspark.generate(model, prompt, max_new_tokens=max_new, temperature=temperature, seed=seed + i,
                              draft_tokens=budget if drafter is not None else 0, drafter=drafter)
        new += out.stats.new_tokens - 1
        rounds += out.stats.rounds
        decode_s += out.stats.decode_s
    return {"tau": new / rounds if rounds else 0.0, "new_tokens": new, "rounds": rounds, "decode_s": decode_s,
            "tok_per_s": new / decode_s if decode_s else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="converted Gemma-3 270M directory (or any HF causal LM)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "hf-gemma.json"))
    ap.add_argument("--train-dir", default=None, help="full prompt sets (default ../shared/data/eval or shared/data/eval)")
    ap.add_argument("--train-prompts", type=int, default=40, help="per domain")
    ap.add_argument("--distill-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--markov-rank", type=int, default=256)
    ap.add_argument("--limit", type=int, default=4, help="evaluation prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=(None, "float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=980406)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train_dir = Path(args.train_dir or next(p for p in ("../shared/data/eval", "shared/data/eval", "/work/shared/data/eval") if Path(p).is_dir()))
    t0 = time.perf_counter()
    model = dspark.load_model(args.model, device=args.device,
                              dtype=getattr(torch, args.dtype) if args.dtype else None)
    conditions = {"model": args.model, "device": args.device, "dtype": str(model.dtype),
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "cpu": platform.processor() or platform.machine(), "threads": args.threads, "batch": 1,
                  "torch": torch.__version__, "commit": _commit(), **{k: v for k, v in vars(args).items()
                                                                       if k not in ("model", "out")}}
    print(json.dumps(conditions), flush=True)

    prompts = training_prompts(model, train_dir, args.train_prompts, max_tokens=256)
    data = self_distill(model, prompts, args.distill_tokens, seed=args.seed)
    config = DSparkConfig.for_target(model.config, dspark_markov_rank=args.markov_rank)
    t1 = time.perf_counter()
    result = train_draft(model, data, TrainConfig(steps=args.steps, num_anchors=args.num_anchors, lr=args.lr,
                                                  seed=args.seed, progress=False), dspark_config=config)
    drafter = result.drafter
    train_s = time.perf_counter() - t1
    cal = calibrate_sts(model, drafter, prompts[: 3 * max(1, args.train_prompts // 8)], 64, 1.0, 1.0, args.seed,
                        "nll")
    drafter.set_calibration(cal)
    tail = result.history[-min(20, len(result.history)):]
    training = {"sequences": len(data), "target_tokens": sum(sum(s.loss_mask) for s in data), "seconds": train_s,
                "dspark_config": config.to_dict(), "stage": vars(model.config.stage),
                "final_loss": sum(h["loss"] for h in tail) / len(tail),
                "final_analytic_tau": sum(h["tau"] for h in tail) / len(tail),
                "sts_temperatures": list(cal.temperatures)}
    print(json.dumps({"training": training}), flush=True)

    methods = {"plain": (None, 0), "ngram": (NgramDrafter(block_size=7), 7), "dspark": (drafter, 7),
               "dspark-auto": (drafter, "auto")}
    rows = []
    for domain, name in EVAL_SETS.items():
        eval_prompts = [encode_prompt(model, t) for t in load_prompts(name)[: args.limit]]
        for temperature in (0.0, 1.0):
            for method, (d, budget) in methods.items():
                row = {"domain": domain, "dataset": name, "temperature": temperature, "method": method,
                       **measure(model, eval_prompts, temperature, args.max_new_tokens, d, budget, args.seed)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:
        plain = next(r for r in rows if r["method"] == "plain" and r["domain"] == row["domain"]
                     and r["temperature"] == row["temperature"])
        row["speedup_vs_plain"] = row["tok_per_s"] / plain["tok_per_s"] if plain["tok_per_s"] else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"format": "dspark-hf-gemma/1", "conditions": conditions,
                                          "training": training, "results": rows,
                                          "total_s": time.perf_counter() - t0}, indent=1) + "\n")
    print(f"[written {args.out}]", flush=True)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


if __name__ == "__main__":
    main()
