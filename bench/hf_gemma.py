"""DSpark on a real transformers target (Gemma-3 270M): train a drafter, then the paper's Table-1 layout.

    python -m dspark.models.hf_causal.gguf --gemma --out models/gemma-3-270m        # once (~75 s)
    # CPU, one thread, ~45 min (bench/results/hf-gemma-cpu.json):
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/hf_gemma.py --model models/gemma-3-270m \
        --out bench/results/hf-gemma-cpu.json --train-prompts 8 --calib-prompts 2 --max-prompt-tokens 128 \
        --distill-tokens 80 --steps 120 --batch-size 4 --micro-batch 4 --cache-target --num-anchors 8 \
        --markov-rank 64 --calib-tokens 48 --limit 4 --max-new-tokens 48
    # H200 (needs the converted directory on the device):
    PYTHONPATH=. python bench/hf_gemma.py --model models/gemma-3-270m --device cuda --threads 4 \
        --out $OUT/hf-gemma-h200.json --train-prompts 40 --calib-prompts 4 --distill-tokens 128 --steps 1000 \
        --batch-size 8 --micro-batch 8 --cache-target --num-anchors 64 --markov-rank 256 --limit 8 \
        --max-new-tokens 128

1. Training prompts: first text turns of the full prompt sets in `--train-dir` (default ../shared/data/eval)
   *minus* every prompt of the shipped evaluation subsets (dspark/data/eval, checked by exact text),
   `--train-prompts` per domain (math: gsm8k, code: mbpp, chat: arena-hard-v2).
2. Target cache: the target's greedy continuations of them (`--distill-tokens`), then `train_draft`
   (γ = 7, five stages, Markov rank `--markov-rank`) for `--steps`, then STS calibration at T = 1 on
   the next `--calib-prompts` prompts of the same sets (neither training nor evaluation prompts).
3. Evaluation at batch 1 on the shipped subsets (first `--limit` prompts of gsm8k, humaneval,
   mt-bench): τ and wall-clock decode speed of plain decoding, n-gram (γ = 7, all verified) and
   DSpark (all verified, and the confidence-scheduled "auto" budget), at T = 0 and T = 1.

Writes one JSON (conditions, deviations from the paper's offline recipe, the training and
calibration prompts by set and line, training summary, ECE before/after STS, per (method, T, domain)
τ, tokens, decode and prefill seconds, speedups over plain). Greedy speculative outputs are asserted
equal to plain outputs. Keep `--threads 1` on shared CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import dspark
from dspark.draft import DSparkConfig, NgramDrafter
from dspark.draft.io import load_drafter, save_drafter
from dspark.evaluate import encode_prompt as encode_text
from dspark.evaluate import load_prompts
from dspark.train.calibrate import calibrate_sts
from dspark.train.data import self_distill
from dspark.train.trainer import TrainConfig, train_draft
from provenance import git_commit

EVAL_SETS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench"}
TRAIN_SETS = {"math": "gsm8k", "code": "mbpp", "chat": "arena-hard-v2"}


# A base model (Gemma-3 270M ships without a chat template) answers nothing to a bare prompt that
# reads as a finished document (it emits EOS at once); a plain question/answer frame makes it answer.
PROMPT_FORMATS = {"raw": "{}", "qa": "Question: {}\nAnswer:"}


def encode_prompt(model, text: str, fmt: str = "raw") -> list[int]:
    """The evaluation encoding (chat template when the tokenizer has one, else `PROMPT_FORMATS[fmt]`
    around the text), with the tokenizer's BOS first when it defines one: Gemma's base model
    degenerates without it."""
    has_template = getattr(model.tokenizer, "chat_template", None)
    ids = encode_text(model, text if has_template else PROMPT_FORMATS[fmt].format(text))
    bos = getattr(model.tokenizer, "bos_token_id", None)
    return ids if bos is None or ids[:1] == [bos] else [bos] + ids


def training_prompts(model, train_dir: Path, counts: tuple[int, int], max_tokens: int, fmt: str
                     ) -> tuple[list[dict], list[dict]]:
    """(training, calibration) prompts per domain set: the first lines of the full sets (in file order)
    that are not in any shipped evaluation subset (exact text) and encode to <= max_tokens, counts[0]
    then counts[1] more per set. Each record: set, line (0-based in the full file), ids."""
    held_out = {p for name in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "arena-hard-v2")
                for p in load_prompts(name)}
    train, calib = [], []
    for name in TRAIN_SETS.values():
        picked = []
        for line, text in _first_turns(train_dir / f"{name}.jsonl"):
            if text in held_out:
                continue
            ids = encode_prompt(model, text, fmt)
            if len(ids) <= max_tokens:
                picked.append({"set": name, "line": line, "ids": ids})
            if len(picked) == sum(counts):
                break
        train += picked[:counts[0]]
        calib += picked[counts[0]:]
    return train, calib


def _first_turns(path: Path) -> list[tuple[int, str]]:
    """(line index, first user turn) of a full prompt set; lines whose first turn is not text are skipped."""
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            turns = json.loads(line).get("turns")
        except (json.JSONDecodeError, AttributeError):  # the full arena-hard file has broken lines
            continue
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            out.append((i, turns[0]))
    return out


def measure(model, prompts: list[list[int]], temperature: float, max_new: int, drafter, budget, seed: int
            ) -> tuple[dict, list[list[int]]]:
    """Batch-1 decoding of every prompt: (τ over all rounds, decode and prefill wall time; the outputs)."""
    new, rounds, decode_s, prefill_s, outputs = 0, 0, 0.0, 0.0, []
    for i, prompt in enumerate(prompts):
        out = dspark.generate(model, prompt, max_new_tokens=max_new, temperature=temperature, seed=seed + i,
                              draft_tokens=budget if drafter is not None else 0, drafter=drafter)
        new += out.stats.new_tokens - 1  # the prefill's token is not a decode round's
        rounds += out.stats.rounds
        decode_s += out.stats.decode_s
        prefill_s += out.stats.prefill_s
        outputs.append(list(out.token_ids))
    return ({"tau": new / rounds if rounds else 0.0, "new_tokens": new, "rounds": rounds, "decode_s": decode_s,
             "prefill_s": prefill_s, "tok_per_s": new / decode_s if decode_s else 0.0}, outputs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="converted Gemma-3 270M directory (or any HF causal LM); not needed by --merge")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "hf-gemma.json"))
    ap.add_argument("--train-dir", default=None, help="full prompt sets (default ../shared/data/eval or shared/data/eval)")
    ap.add_argument("--train-prompts", type=int, default=40, help="per domain")
    ap.add_argument("--calib-prompts", type=int, default=2, help="per domain, after the training ones (STS)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="training/calibration prompts longer are skipped")
    ap.add_argument("--prompt-format", choices=tuple(PROMPT_FORMATS), default="qa",
                    help="frame of the text when the tokenizer has no chat template")
    ap.add_argument("--distill-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per target/drafter call")
    ap.add_argument("--cache-target", action="store_true", help="keep the target's rows after their first pass")
    ap.add_argument("--num-anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--markov-rank", type=int, default=256)
    ap.add_argument("--calib-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=4, help="evaluation prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--save-drafter", default=None, help="also write the drafter directory here (not committed)")
    ap.add_argument("--phase", choices=("all", "train", "eval"), default="all",
                    help="train: steps 1-2 only, written to --drafter-dir; eval: step 3 with the drafter of --drafter-dir")
    ap.add_argument("--drafter-dir", default=None, help="where --phase train writes and --phase eval reads the drafter")
    ap.add_argument("--domains", default=",".join(EVAL_SETS), help="evaluation domains, comma-separated")
    ap.add_argument("--temperatures", default="0,1", help="evaluation temperatures, comma-separated (0 and/or 1)")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="only merge these result files of --phase eval runs over disjoint domains into --out")
    ap.add_argument("--from-logs", nargs="+", default=None,
                    help="only write --out from the rows these --phase eval logs printed (runs cut short), with the "
                         "training summary of --drafter-dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=(None, "float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--progress", action="store_true", help="training progress bar (stderr)")
    ap.add_argument("--seed", type=int, default=980406)
    args = ap.parse_args()
    if args.merge:
        return merge_results(args.merge, args.out)
    if args.from_logs:
        return write_from_logs(args.from_logs, args.drafter_dir, args.out)
    if not args.model:
        ap.error("--model is required (except with --merge or --from-logs)")
    domains = args.domains.split(",")
    if not set(domains) <= set(EVAL_SETS) or not domains:
        raise ValueError(f"--domains must name some of {sorted(EVAL_SETS)}, got {args.domains!r}")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if not set(temperatures) <= {0.0, 1.0} or not temperatures:
        raise ValueError(f"--temperatures must name 0 and/or 1, got {args.temperatures!r}")
    if args.phase != "all" and not args.drafter_dir:
        raise ValueError(f"--phase {args.phase} needs --drafter-dir")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = dspark.load_model(args.model, device=args.device,
                              dtype=getattr(torch, args.dtype) if args.dtype else None)
    conditions = {"model": args.model, "device": args.device, "model_dtype": str(model.dtype),
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "cpu": _cpu_name(), "threads": args.threads, "batch": 1, "python": platform.python_version(),
                  "torch": torch.__version__, "transformers": transformers.__version__, "commit": git_commit(),
                  "command": " ".join(["python"] + sys.argv),
                  **{k: v for k, v in vars(args).items() if k not in ("model", "out")}}
    print(json.dumps(conditions), flush=True)
    if args.phase == "eval":
        drafter = load_drafter(args.drafter_dir, model)
        saved = json.loads((Path(args.drafter_dir) / SUMMARY_FILE).read_text())
        training, calibration = saved["training"], saved["calibration"]
        config = DSparkConfig.from_dict(saved["dspark_config"])
        conditions["train_conditions"] = saved["conditions"]
    else:
        drafter, training, calibration, config = train_phase(model, args, conditions)
        if args.phase == "train":
            return
    t1 = time.perf_counter()
    rows = evaluate(model, drafter, args, domains, temperatures)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"format": "dspark-hf-gemma/2", "conditions": conditions,
                                          "deviations": paper_deviations(conditions.get("train_conditions", vars(args)), config.to_dict()),
                                          "training": training, "calibration": calibration,
                                          "eval": {"sets": {d: f"dspark/data/eval/{EVAL_SETS[d]}.jsonl, first "
                                                               f"{args.limit} lines" for d in domains},
                                                   "seconds": time.perf_counter() - t1,
                                                   "greedy_outputs_equal_plain": all(
                                                       r.get("greedy_equal_plain", True) for r in rows)},
                                          "results": rows, "total_s": time.perf_counter() - t0}, indent=1) + "\n")
    print(f"[written {args.out}]", flush=True)


SUMMARY_FILE = "hf-gemma-summary.json"


def train_phase(model, args, conditions: dict):
    """Steps 1-2: training and calibration prompts, target cache, `train_draft`, STS.

    Returns (drafter, training summary, calibration summary, DSparkConfig). With `--drafter-dir`,
    the drafter (with its `sts.json`) and the summaries are written there for `--phase eval`."""
    train_dir = Path(args.train_dir or next(p for p in ("../shared/data/eval", "shared/data/eval",
                                                         "/work/shared/data/eval") if Path(p).is_dir()))
    conditions["train_dir"] = str(train_dir)
    train, calib = training_prompts(model, train_dir, (args.train_prompts, args.calib_prompts),
                                    args.max_prompt_tokens, args.prompt_format)
    t1 = time.perf_counter()
    data = self_distill(model, [r["ids"] for r in train], args.distill_tokens, seed=args.seed)
    distill_s = time.perf_counter() - t1
    print(f"[target cache: {len(data)} sequences in {distill_s:.1f} s]", flush=True)
    config = DSparkConfig.for_target(model.config, dspark_markov_rank=args.markov_rank)
    t1 = time.perf_counter()
    result = train_draft(model, data, TrainConfig(steps=args.steps, batch_size=args.batch_size,
                                                  micro_batch=args.micro_batch, cache_target=args.cache_target,
                                                  num_anchors=args.num_anchors, lr=args.lr, seed=args.seed,
                                                  progress=args.progress), dspark_config=config)
    drafter = result.drafter
    train_s = time.perf_counter() - t1
    t1 = time.perf_counter()
    cal = calibrate_sts(model, drafter, [r["ids"] for r in calib], args.calib_tokens, 1.0, 1.0, args.seed, "nll",
                        dataset="calibration prompts (conditions.calibration_prompts)")
    calib_s = time.perf_counter() - t1
    drafter.set_calibration(cal)
    drafter_bytes = sum(p.numel() * p.element_size() for p in drafter.model.parameters())
    tail = result.history[-min(20, len(result.history)):]
    training = {"prompts": [{"set": r["set"], "line": r["line"], "tokens": len(r["ids"])} for r in train],
                "sequences": len(data), "target_tokens": sum(sum(s.loss_mask) for s in data),
                "distill_seconds": distill_s, "seconds": train_s,
                "dspark_config": config.to_dict(), "stage": vars(model.config.stage),
                "drafter_params": sum(p.numel() for p in drafter.model.parameters()),
                "drafter_fp32_mb": drafter_bytes / 2**20,
                "markov_head_params": sum(p.numel() for n, p in drafter.model.named_parameters() if "markov" in n),
                "first_loss": sum(h["loss"] for h in result.history[:20]) / min(20, len(result.history)),
                "final_loss": sum(h["loss"] for h in tail) / len(tail),
                "final_analytic_tau": sum(h["tau"] for h in tail) / len(tail)}
    calibration = {"prompts": [{"set": r["set"], "line": r["line"], "tokens": len(r["ids"])} for r in calib],
                   "temperature": 1.0, "max_new_tokens": args.calib_tokens, "objective": "nll",
                   "rounds": cal.num_samples, "sts_temperatures": list(cal.temperatures),
                   "ece_before": list(cal.ece_before), "ece_after": list(cal.ece_after),
                   "mean_ece_before": sum(cal.ece_before) / len(cal.ece_before),
                   "mean_ece_after": sum(cal.ece_after) / len(cal.ece_after), "seconds": calib_s}
    print(json.dumps({"training": {k: v for k, v in training.items() if k != "prompts"},
                      "calibration": calibration}), flush=True)
    for path in filter(None, (args.save_drafter, args.drafter_dir)):
        save_drafter(drafter, path)
        (Path(path) / SUMMARY_FILE).write_text(json.dumps(
            {"conditions": conditions, "training": training, "calibration": calibration,
             "dspark_config": config.to_dict()}, indent=1) + "\n")
    return drafter, training, calibration, config


def evaluate(model, drafter, args, domains: list[str], temperatures: list[float]) -> list[dict]:
    """Step 3 over `domains` × `temperatures`: one row per (domain, T, method), with speedups over
    plain in the same run. Each method first decodes one untimed prompt (kernel compilation and
    allocator warm-up would otherwise land on whichever row runs first). At T = 0 every row records
    whether its outputs equal plain decoding's and, where not, the first split and plain's top-2
    logit margin there (a near-tie that a different row count rounds the other way, or a bug)."""
    methods = {"plain": (None, 0), "ngram": (NgramDrafter(block_size=7), 7), "dspark": (drafter, 7),
               "dspark-auto": (drafter, "auto")}
    warm = [encode_prompt(model, load_prompts(EVAL_SETS[domains[0]])[0], args.prompt_format)]
    for d, budget in methods.values():
        measure(model, warm, 0.0, 16, d, budget, args.seed)
    rows = []
    for domain in domains:
        name = EVAL_SETS[domain]
        eval_prompts = [encode_prompt(model, t, args.prompt_format) for t in load_prompts(name)[: args.limit]]
        for temperature in temperatures:
            outputs = {}
            for method, (d, budget) in methods.items():
                row, outputs[method] = measure(model, eval_prompts, temperature, args.max_new_tokens, d, budget,
                                               args.seed)
                if temperature == 0.0:
                    row["greedy_splits"] = greedy_splits(model, eval_prompts, outputs["plain"], outputs[method])
                    row["greedy_equal_plain"] = not row["greedy_splits"]
                rows.append({"domain": domain, "dataset": name, "temperature": temperature, "method": method, **row})
                print(json.dumps(rows[-1]), flush=True)
    add_speedups(rows)
    return rows


def greedy_splits(model, prompts: list[list[int]], plain: list[list[int]], other: list[list[int]]) -> list[dict]:
    """For each prompt whose greedy output differs from plain's: where, and plain's top-2 margin there."""
    splits = []
    for i, (prompt, a, b) in enumerate(zip(prompts, plain, other)):
        if a == b:
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ids = torch.tensor(prompt + a[:j], device=model.device)
        with torch.inference_mode():
            logits = model(ids, [model.new_state()], [ids.numel()]).logits[-1].float()
        top = logits.topk(2)
        splits.append({"prompt": i, "token": j, "plain_token": a[j] if j < len(a) else None,
                       "other_token": b[j] if j < len(b) else None,
                       "plain_top2_margin": float(top.values[0] - top.values[1])})
    return splits


def write_from_logs(logs: list[str], drafter_dir: str, out: str) -> None:
    """--out from cut-short eval logs: each log's conditions line, the rows, the training summary."""
    saved = json.loads((Path(drafter_dir) / SUMMARY_FILE).read_text())
    runs = []
    for path in logs:
        first = next(line for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
                     if line.startswith("{") and '"command"' in line)
        runs.append({"log": Path(path).name, "conditions": json.loads(first)})
    rows = rows_from_logs(logs)
    failed = [line.strip() for path in logs for line in Path(path).read_text(errors="replace").splitlines()
              if line.startswith("AssertionError")]
    result = {"format": "dspark-hf-gemma/2", "runs": runs, "train_conditions": saved["conditions"],
              "training": saved["training"], "calibration": saved["calibration"],
              "eval": {"complete": False, "cells": sorted({(r["domain"], r["temperature"]) for r in rows}),
                       "greedy_outputs_equal_plain": not failed and all(r.get("greedy_equal_plain", True) for r in rows),
                       "assertions": failed},
              "results": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"[written {out}]", flush=True)


def add_speedups(rows: list[dict]) -> None:
    """Speed of each row over plain decoding's at the same (domain, T), decode-only and end to end."""
    for row in rows:
        plain = next((r for r in rows if r["method"] == "plain" and r["domain"] == row["domain"]
                      and r["temperature"] == row["temperature"]), None)
        if plain is None:
            continue
        row["speedup_vs_plain"] = row["tok_per_s"] / plain["tok_per_s"] if plain["tok_per_s"] else None
        row["e2e_speedup_vs_plain"] = ((plain["decode_s"] + plain["prefill_s"]) / (row["decode_s"] + row["prefill_s"])
                                       * row["new_tokens"] / plain["new_tokens"])


def rows_from_logs(paths: list[str]) -> list[dict]:
    """The result rows a run printed (one JSON object per line with a "method"), for runs cut short
    by a time limit or an assertion before their result file was written; speedups recomputed."""
    rows = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("{") and '"method"' in line:
                rows.append(json.loads(line))
    add_speedups(rows)
    return rows


def merge_results(paths: list[str], out: str) -> None:
    """One result file from `--phase eval` runs over disjoint domains (the first file's header)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(parts[0])
    merged["results"] = [row for part in parts for row in part["results"]]
    merged["eval"] = dict(parts[0]["eval"], sets={k: v for part in parts for k, v in part["eval"]["sets"].items()},
                          seconds=sum(part["eval"]["seconds"] for part in parts), parallel_runs=[
                              {"command": part["conditions"]["command"], "gpu": part["conditions"]["gpu"]}
                              for part in parts])
    keys = [(r["domain"], r["temperature"], r["method"]) for r in merged["results"]]
    if len(keys) != len(set(keys)):
        raise ValueError(f"--merge: the files {paths} overlap in (domain, temperature, method)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"[written {out}]", flush=True)

# The DSpark paper's offline recipe as dspark ships it (TrainConfig defaults, spec §5.6; γ = 7, one
# stage per target layer id, Markov rank 256), against which a run's settings are listed.
PAPER_OFFLINE = {"markov_rank": 256, "num_anchors": 512, "lr": 6e-4, "stages": 5, "block_size": 7}


def paper_deviations(args: dict, dspark_config: dict) -> dict:
    """{setting: {"run": value, "paper": value}} for every setting that differs from PAPER_OFFLINE,
    plus the data scale (the paper trains on a large instruction set for many steps)."""
    run = {"markov_rank": dspark_config["dspark_markov_rank"], "num_anchors": args["num_anchors"], "lr": args["lr"],
           "stages": len(dspark_config["dspark_target_layer_ids"]), "block_size": dspark_config["dspark_block_size"]}
    out = {k: {"run": v, "paper": PAPER_OFFLINE[k]} for k, v in run.items() if v != PAPER_OFFLINE[k]}
    out["data"] = {"run": f"{args['train_prompts']} prompts per domain x {args['distill_tokens']} greedy target "
                          f"tokens, {args['steps']} steps of {args['batch_size']} sequences",
                   "paper": "a large instruction set, target-regenerated, trained for many epochs"}
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
