"""Pretraining a target from scratch on packed tokens: next-token cross-entropy, AdamW, warmup + cosine.

    model = dspark.init_model(fit_config(config, tokenizer), seed)     any family (V4, V4.1)
    each step: B packed rows -> one ragged forward (one fresh request per row, the whole row in one
               call) -> CE(logits[:-1], row[1:]) -> clip -> AdamW -> expert-bias balancing step
    every `eval_every` steps and at the end: held-out CE per domain
    save: config.json + safetensors (`save_checkpoint(quantize=False)` of the family) + tokenizer

Stopping: the schedule's progress is `max(step / steps, elapsed / time budget)`, so a run ends after
`steps` steps or when the wall-clock budget (less a reserve for the final evaluation and the save)
is spent, whichever comes first, and the cosine decay completes either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import dspark
from dspark.tiny.balance import ExpertBalancer
from dspark.tiny.model_config import DSPARK_TINY, fit_config, load_config, training_options
from dspark.tiny.packing import PackedData, load_packed
from dspark.tiny.tokenizer import TOKENIZER_FILES, load_tokenizer

METRICS_FILE = "pretrain.json"
# Compute precision on CUDA: bf16 autocast over fp32 master weights, or plain fp32 (at this model
# size a step is bound by the number of kernel launches, not by arithmetic, so fp32 costs little).
PRECISIONS = ("bf16", "fp32")
SAVE_DTYPES = MappingProxyType({"bfloat16": torch.bfloat16, "float32": torch.float32})
# Shards stay under the 16 MiB per file that a GPU job can send back (bench/train_tiny.sh).
MAX_SHARD_BYTES = 15 << 20


@dataclass(frozen=True)
class PretrainConfig:
    """Hyper-parameters of one run; validated at construction (ValueError names the bad value)."""

    steps: int = 2000
    max_minutes: float | None = None
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    balance_rate: float = 1e-3
    eval_every: int = 200
    eval_rows: int = 64
    eval_batch_size: int = 32
    reserve_s: float = 45.0
    seed: int = 0
    cache_qat: bool = False
    precision: str = "bf16"
    save_dtype: str = "bfloat16"
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "eval_rows", "eval_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {value!r} must be an int >= 1")
        if self.max_minutes is not None and not self.max_minutes * 60 > self.reserve_s:
            raise ValueError(f"max_minutes: {self.max_minutes!r} must leave time after reserve_s={self.reserve_s} "
                             f"seconds for the final evaluation and the save (or be None: no time limit)")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr {self.lr!r} must be > 0 and min_lr_ratio {self.min_lr_ratio!r} in [0, 1]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or not self.grad_clip > 0 or self.reserve_s < 0:
            raise ValueError(f"warmup_steps {self.warmup_steps!r}, weight_decay {self.weight_decay!r}, reserve_s "
                             f"{self.reserve_s!r} must be >= 0 and grad_clip {self.grad_clip!r} > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: {self.betas!r} must lie in [0, 1)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: {self.precision!r} is not one of {PRECISIONS}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype: {self.save_dtype!r} is not one of {sorted(SAVE_DTYPES)}")


def lr_at(config: PretrainConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from `lr` to `min_lr_ratio · lr` over progress [0, 1]."""
    warm = min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * warm * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def lm_loss(model, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE of rows [B, L + 1] (inputs row[:-1], targets row[1:]), one request per row."""
    batch, length = rows.shape[0], rows.shape[1] - 1
    states = [model.new_state() for _ in range(batch)]  # fresh: each row is a whole request
    out = model(rows[:, :-1].reshape(-1), states, [length] * batch)
    return F.cross_entropy(out.logits, rows[:, 1:].reshape(-1))


def _autocast(device: torch.device, precision: str = "bf16"):
    """bf16 autocast on CUDA when asked (the fp32 master weights stay in the optimiser); fp32 otherwise."""
    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def _to_device(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model, rows: np.ndarray, batch_size: int, precision: str = "bf16") -> float:
    """Token-weighted mean CE (nats/token) over all rows [n, L + 1]."""
    if len(rows) == 0:
        return float("nan")
    device = model.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(rows), batch_size):
        chunk = _to_device(rows[start:start + batch_size], device)
        with _autocast(device, precision):
            total += lm_loss(model, chunk).double() * chunk.shape[0]
    return float(total / len(rows))


def _eval_subset(data: PackedData, n: int) -> dict[str, np.ndarray]:
    """Up to n evenly spaced held-out rows per domain: the periodic evaluation's fixed sample."""
    return {d: rows[np.linspace(0, len(rows) - 1, min(n, len(rows))).round().astype(np.int64)] if len(rows) else rows
            for d, rows in data.heldout.items()}


def _optimizer(model, config: PretrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains, sinks, mHC scales and bases keep theirs)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=device.type == "cuda")


def pretrain(model_config: dict, data: PackedData, tokenizer, config: PretrainConfig = PretrainConfig(),
             device: str | torch.device = "cpu"):
    """Train a model of `model_config` (fitted to `tokenizer`) on `data`; returns (model, metrics).

    The model is built in fp32 with the family's training options (:func:`training_options`), its
    routing biases handled by :class:`ExpertBalancer`, and returned in eval mode, frozen again.
    `metrics` holds the run's settings, the train loss every 10 steps, the held-out CE per domain
    at step 0, every `eval_every` steps (fixed subset of `eval_rows` rows) and at the end (all
    held-out rows), and the throughput without evaluation time.
    """
    device = torch.device(device)
    start = time.perf_counter()
    budget = None if config.max_minutes is None else config.max_minutes * 60 - config.reserve_s
    fitted = fit_config(model_config, tokenizer)
    options = training_options(fitted, config.cache_qat)
    model = dspark.init_model(fitted, seed=config.seed, device=device, dtype=torch.float32, **options)
    model.has_mtp = False  # pretraining trains no MTP block; an untrained one must never draft
    if hasattr(model, "bind_tokenizer") and getattr(model, "engram_ids", ()):
        model.bind_tokenizer(tokenizer)  # the Engram hashes the checkpoint will use (spec §8.1)
    model.train().requires_grad_(True)
    balancer = ExpertBalancer(model, config.balance_rate)
    optimizer = _optimizer(model, config, device)
    batches = _batches(len(data.train), config.batch_size, config.seed)
    eval_rows = _eval_subset(data, config.eval_rows)
    metrics = {"config": dataclasses.asdict(config), "model_config": fitted, "model_options": options,
               "device": str(device), "torch": torch.__version__, "train_loss": [], "heldout": [], "eval_s": 0.0}
    _record_eval(model, eval_rows, config, metrics, 0, 0, start)
    step, tokens, progress = 0, 0, 0.0
    bar = tqdm(total=config.steps, disable=not config.progress, unit="step", dynamic_ncols=True)
    while progress < 1.0:
        rows = _to_device(data.train[next(batches)], device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, step, progress)
        with balancer.observe(), _autocast(device, config.precision):
            loss = lm_loss(model, rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        imbalance = balancer.update()
        step, tokens = step + 1, tokens + rows.shape[0] * (rows.shape[1] - 1)
        elapsed = time.perf_counter() - start
        progress = max(step / config.steps, elapsed / budget if budget else 0.0)
        if step % 10 == 0 or progress >= 1.0:
            _log_step(metrics, bar, step, float(loss.detach()), optimizer, tokens, elapsed, imbalance)
        bar.update(1)
        if step % config.eval_every == 0 and progress < 1.0:
            _record_eval(model, eval_rows, config, metrics, step, tokens, start)
    bar.close()
    _record_eval(model, data.heldout, config, metrics, step, tokens, start)
    train_s = time.perf_counter() - start - metrics["eval_s"]
    metrics.update(steps=step, tokens=tokens, train_s=round(train_s, 2), tokens_per_s=round(tokens / train_s, 1),
                   stopped_by="steps" if step >= config.steps else "time", final_heldout=metrics["heldout"][-1])
    return model.eval().requires_grad_(False), metrics


def _batches(n_rows: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless row-index batches: a seeded permutation per epoch, each batch sorted (mmap locality)."""
    if n_rows < batch_size:  # checked here, not at the first draw, so nothing runs before the error
        raise ValueError(f"batch_size: {batch_size} exceeds the {n_rows} packed train rows")

    def draw():
        generator = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(n_rows, generator=generator).numpy()
            for start in range(0, n_rows - batch_size + 1, batch_size):
                yield np.sort(perm[start:start + batch_size])
    return draw()


def _log_step(metrics: dict, bar, step: int, loss: float, optimizer, tokens: int, elapsed: float,
              imbalance: torch.Tensor | None) -> None:
    metrics["train_loss"].append([step, round(loss, 5)])
    rate = tokens / max(elapsed - metrics["eval_s"], 1e-9)
    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}", tok_s=f"{rate:.0f}",
                    imbalance="-" if imbalance is None else f"{float(imbalance):.2f}")


def _record_eval(model, rows: dict[str, np.ndarray], config: PretrainConfig, metrics: dict, step: int,
                 tokens: int, start: float) -> None:
    """Held-out CE per domain into `metrics["heldout"]`; its time goes to `metrics["eval_s"]`."""
    began, was_training = time.perf_counter(), model.training
    model.eval()
    entry = {"step": step, "tokens": tokens,
             **{d: round(evaluate(model, r, config.eval_batch_size, config.precision), 5) for d, r in rows.items()}}
    model.train(was_training)
    if metrics["train_loss"]:  # the log line of a run without a progress bar carries the train side too
        entry["train_loss"] = metrics["train_loss"][-1][1]
        entry["train_tok_s"] = round(tokens / max(began - start - metrics["eval_s"], 1e-9), 1)
    metrics["eval_s"] = round(metrics["eval_s"] + time.perf_counter() - began, 3)
    entry["elapsed_s"] = round(time.perf_counter() - start, 2)
    metrics["heldout"].append(entry)
    tqdm.write(f"held-out {json.dumps(entry)}")  # above the bar, if there is one
    sys.stdout.flush()


def save_pretrained(model, out: str | Path, tokenizer_dir: str | Path, metrics: dict | None = None,
                    save_dtype: str = "bfloat16") -> Path:
    """Write `model` in its family's standard layout (unquantised, weights cast to `save_dtype`
    where the family keeps them in the model dtype) with the tokenizer files and the metrics.

    An MTP block that pretraining never trained is left out, so loading does not mistake it for a
    drafter.
    """
    out = Path(out)
    config = metrics["model_config"] if metrics else json.loads(json.dumps(model.config.to_dict()))
    options = metrics["model_options"] if metrics else {}
    if SAVE_DTYPES[save_dtype] == model.dtype and model.device.type == "cpu":
        target = model
    else:  # a fresh CPU model in the save dtype (the module must not be re-cast in place)
        target = dspark.init_model(config, device="cpu", dtype=SAVE_DTYPES[save_dtype], **options)
        target.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    if getattr(target, "has_mtp", False):
        target.has_mtp = False
    checkpoint = importlib.import_module(f"dspark.models.{config['model_type']}.checkpoint")
    checkpoint.save_checkpoint(target, out, quantize=False, max_shard_bytes=MAX_SHARD_BYTES)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    if metrics is not None:
        (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    d = PretrainConfig()
    p = argparse.ArgumentParser(prog="python -m dspark.tiny.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DSPARK_TINY, help=f"{DSPARK_TINY} (shipped), a config.json or its directory")
    p.add_argument("--data", type=Path, default=Path("tiny-data/packed"))
    p.add_argument("--tokenizer", type=Path, default=Path("tiny-data/tokenizer"))
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="wall-clock budget incl. eval + save")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--balance-rate", type=float, default=d.balance_rate)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-rows", type=int, default=d.eval_rows)
    p.add_argument("--reserve-s", type=float, default=d.reserve_s, help="seconds kept for final eval + save")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--cache-qat", action="store_true", help="train through the V4.1 cache QAT casts")
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision, help="CUDA compute: bf16 autocast or fp32")
    p.add_argument("--save-dtype", choices=sorted(SAVE_DTYPES), default=d.save_dtype)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads (default: torch's; 1 avoids oversubscribing a shared small machine)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)  # the process edge: the library functions never do this
    config = PretrainConfig(steps=args.steps, max_minutes=args.max_minutes, batch_size=args.batch_size, lr=args.lr,
                            min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                            weight_decay=args.weight_decay, grad_clip=args.grad_clip, balance_rate=args.balance_rate,
                            eval_every=args.eval_every, eval_rows=args.eval_rows, reserve_s=args.reserve_s,
                            seed=args.seed, cache_qat=args.cache_qat, precision=args.precision,
                            save_dtype=args.save_dtype,
                            progress=not args.no_progress)
    tokenizer = load_tokenizer(args.tokenizer)
    data = load_packed(args.data, args.tokenizer)
    model, metrics = pretrain(load_config(args.config), data, tokenizer, config, args.device)
    save_pretrained(model, args.out, args.tokenizer, metrics, config.save_dtype)
    print(f"wrote {args.out}: {metrics['steps']} steps, {metrics['tokens']} tokens, "
          f"{metrics['tokens_per_s']:.0f} tok/s, held-out {json.dumps(metrics['final_heldout'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
