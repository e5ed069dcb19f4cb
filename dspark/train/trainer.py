"""`train_draft`: the DSpark training recipe (dspark spec §5) against a frozen target, online.

One optimizer step over `batch_size` sequences:

    for each sequence (ids [L], loss mask [L]):
        target(ids) once, no grad           -> features {ℓ: [L, n_hc, D]} and logits [L, V]
        anchors (≤ num_anchors), blocks     -> dspark.train.anchors
        main_x = main_norm(main_proj(..))   -> per-stage context keys of all L positions
        stages over the N·γ block rows, each seeing positions a−W .. a−1 and its own block
        Markov bias and confidence teacher-forced on the true previous tokens
        loss (0.1·CE + 0.9·TV + 1.0·BCE) / Σ w of the whole step, backward
    clip the gradient norm to 1.0, AdamW step, LR schedule step (linear warmup, cosine to 0)

The target's embedding and head are shared and frozen (used detached); the features and teacher
distributions come from the target at train time (kept in memory after the first pass with
`cache_target`; nothing is written to disk). The drafter's weights are
kept in fp32 whatever the target's dtype (fp32 master weights; inference casts at its inputs).
Everything random flows from `seed`: the drafter's init, the sequence order and the anchors.

Shape symbols: L sequence length, N blocks, γ block size, V vocabulary, D hidden size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.draft.config import DSparkConfig
from dspark.draft.drafter import DSparkDrafter
from dspark.draft.dspark_v4 import DSparkModel, target_kernels, uses_v41_stages
from dspark.draft.io import save_drafter, v41_dspark_config
from dspark.train.anchors import AnchorBlocks, build_blocks, concat_blocks, context_index, sample_anchors
from dspark.train.data import TrainingSequence
from dspark.train.losses import LossWeights, dspark_loss, probabilistic_tau
from dspark.train.target_cache import TargetCache


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; defaults are the released recipe (spec §5.6) but for the step count.

    steps : optimizer steps; batch_size : sequences per step; num_anchors : blocks per sequence;
    lr, weight_decay, warmup_ratio, grad_clip : AdamW with linear warmup then cosine to 0;
    loss_weights : CE / TV / confidence mix; decay : g of exp(−k/g), None = 4·γ/7;
    max_length : sequences are cut to this many tokens; seed; save_every : also write
    `checkpoint-{step}` every that many steps (0 = only the final drafter); progress : tqdm bar;
    micro_batch : sequences per target/drafter call (same loss to rounding; more uses more memory);
    cache_target : keep each sequence's target features and logits after its first pass
    (`dspark.train.target_cache`): later epochs run the drafter only.
    """

    steps: int = 1000
    batch_size: int = 1
    num_anchors: int = 512
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    loss_weights: LossWeights = LossWeights()
    decay: float | None = None
    max_length: int = 4096
    seed: int = 42
    save_every: int = 0
    progress: bool = True
    micro_batch: int = 1
    cache_target: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_size", "num_anchors", "max_length", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not isinstance(self.warmup_ratio, (int, float)) or not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must lie in [0, 1), got {self.warmup_ratio!r}")
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 0:
            raise ValueError(f"save_every must be an int >= 0, got {self.save_every!r}")


@dataclass
class TrainResult:
    """The trained drafter and one metrics dict per step (loss, ce, tv, conf, accept, tau, lr)."""

    drafter: DSparkDrafter
    history: list[dict] = field(default_factory=list)


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Multiplier of the base LR before optimizer step `step` (0-based): linear warmup over
    ceil(warmup_ratio·total) steps, then cosine from 1 to 0 at `total`."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def new_training_drafter(target, config: DSparkConfig | None = None, seed: int = 0,
                         stage_kind: str = "v4") -> DSparkDrafter:
    """A randomly initialised drafter for `target` with fp32 weights on the target's device.

    `stage_kind` ("v4" or "shipped", `dspark_v4.STAGE_KINDS`): "shipped" on a DeepSeek-V4.1 target
    trains the release's own stage modules (V4.1 blocks), configured by default by the target's
    `dspark_*` fields as its checkpoint ships them (`io.v41_dspark_config`), so that `add_to_checkpoint`
    can store the result where the release keeps its stages."""
    if config is None:
        config = v41_dspark_config(target.config) if uses_v41_stages(target.config, stage_kind) \
            else DSparkConfig.for_target(target.config)
    model = DSparkModel(config, target.config, dtype=torch.float32, device=target.device, stage_kind=stage_kind,
                        cache_qat=getattr(target, "cache_qat", True), kernels=target_kernels(target))
    return DSparkDrafter(target, config, model).init_weights(seed)


def target_pass(target, ids: torch.Tensor | list[torch.Tensor], capture: tuple[int, ...]):
    """Frozen target over whole sequences in one ragged call: ids [L] or a list of [L_b] ->
    (features {ℓ: [ΣL, n_hc, D]}, logits fp32 [ΣL, V]), the sequences' rows one after another.

    Every row is needed (features and teacher at every anchor), so a target with a bounded-replay
    prefill (DeepSeek-V4.1) runs it exactly here.
    """
    seqs = [ids] if isinstance(ids, torch.Tensor) else list(ids)
    extra = {"prefill_mode": "exact"} if hasattr(target, "prefill_mode") else {}
    flat = torch.cat(seqs).to(target.device)
    with torch.no_grad():
        out = target(flat, [target.new_state() for _ in seqs], [s.shape[0] for s in seqs],
                     capture_layers=capture, **extra)
    return out.features, out.logits


def draft_forward(drafter: DSparkDrafter, features: dict[int, torch.Tensor], blocks: AnchorBlocks,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft logits fp32 [N, γ, V] and confidence logits fp32 [N, γ] of `blocks`, from
    target features {ℓ: [L, n_hc, D]}; differentiable in the drafter. positions [L]: the position of
    each feature row (default 0..L−1, one sequence; `concat_blocks` groups pass each sequence's own)."""
    model, target, gamma = drafter.model, drafter.target, drafter.block_size
    device = model.device
    length = next(iter(features.values())).shape[0]
    positions = torch.arange(length) if positions is None else positions
    main_x = model.main_x(features)  # [L, D]
    pools = model.context_latents(main_x, positions.to(device))  # keys of every row
    block_ids = blocks.input_ids.flatten().to(device)
    with torch.no_grad():
        embeds = target.embed(block_ids.to(target.device)).to(device)  # frozen, shared embedding
    index = context_index(blocks.anchors, drafter.window, blocks.pool_offset).to(device)
    out = model.blocks(embeds, block_ids, blocks.positions.flatten().to(device), pools,
                       index.repeat_interleave(gamma, dim=0), target.head.weight.detach())
    return model.teacher_forced(out, blocks.prev.to(device))


def block_losses(drafter: DSparkDrafter, ids: torch.Tensor | list[torch.Tensor],
                 blocks: AnchorBlocks | list[AnchorBlocks], loss_weights: LossWeights,
                 normalizer: float, target_out: tuple[dict, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
    """Loss share and metrics of the blocks of one sequence ids [L], or of several sequences (lists
    of ids [L_b] and their blocks) in one target call and one drafter call (module docstring).
    target_out: the target's (features, logits) of these sequences when already known (a cache)."""
    seqs = [ids] if isinstance(ids, torch.Tensor) else list(ids)
    groups = [blocks] if isinstance(blocks, AnchorBlocks) else list(blocks)
    lengths = [s.shape[0] for s in seqs]
    merged = groups[0] if len(groups) == 1 else concat_blocks(groups, lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    features, target_logits = target_out or target_pass(drafter.target, seqs, drafter.capture_layers)
    logits, conf_logits = draft_forward(drafter, features, merged, positions)
    device = logits.device
    teacher = target_logits[merged.teacher_rows.to(target_logits.device)].to(device).float().softmax(dim=-1)
    loss, metrics = dspark_loss(logits, conf_logits, teacher, merged.labels.to(device), merged.weights,
                                loss_weights, normalizer)
    accept = (1 - 0.5 * (logits.detach().softmax(-1) - teacher).abs().sum(-1)).clamp(0, 1)
    metrics["tau"] = probabilistic_tau(accept.cpu(), merged.weights > 0)
    return loss, metrics


def _prepare(sequences: list[TrainingSequence], max_length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, mask) tensors of every sequence that has at least one anchor after truncation."""
    out = []
    for seq in sequences:
        seq = seq.truncated(max_length)
        ids, mask = torch.tensor(seq.input_ids, dtype=torch.long), torch.tensor(seq.loss_mask, dtype=torch.long)
        if ids.numel() >= 2 and bool((mask[:-1] & mask[1:]).any()):
            out.append((ids, mask))
    if not out:
        raise ValueError("sequences: none has two consecutive response tokens (loss_mask) to anchor a block")
    return out


def _order(n: int, steps: int, batch: int, generator: torch.Generator) -> list[list[int]]:
    """Sequence indices of each step: seeded epochs (permutations) laid end to end."""
    flat: list[int] = []
    while len(flat) < steps * batch:
        flat.extend(torch.randperm(n, generator=generator).tolist())
    return [flat[i * batch:(i + 1) * batch] for i in range(steps)]


def train_draft(target, sequences: list[TrainingSequence], config: TrainConfig = TrainConfig(),
                drafter: DSparkDrafter | None = None, dspark_config: DSparkConfig | None = None,
                out_dir: str | Path | None = None, stage_kind: str = "v4") -> TrainResult:
    """Train a DSpark drafter for the frozen `target` (module docstring).

    `drafter` continues an existing drafter (its weights are trained in place); otherwise a new one is
    built from `dspark_config` and `stage_kind` (`new_training_drafter`) and seeded with `config.seed`.
    With `out_dir`, the final drafter directory and `history.jsonl` are written there.
    """
    data = _prepare(sequences, config.max_length)
    drafter = drafter or new_training_drafter(target, dspark_config, config.seed, stage_kind)
    model = drafter.model.train().requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.steps, config.warmup_ratio))
    generator = torch.Generator().manual_seed(config.seed)
    result = TrainResult(drafter)
    cache = TargetCache(lambda seqs: target_pass(target, seqs, drafter.capture_layers)) if config.cache_target else None
    bar = tqdm(_order(len(data), config.steps, config.batch_size, generator), desc="train-draft",
               disable=not config.progress)
    for step, members in enumerate(bar, 1):
        metrics = _step(drafter, members, data, config, generator, optimizer, params, cache)
        metrics["lr"] = schedule.get_last_lr()[0]
        schedule.step()
        result.history.append(metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau']:.2f}")
        if out_dir is not None and config.save_every and step % config.save_every == 0:
            save_drafter(drafter, Path(out_dir) / f"checkpoint-{step}")
    model.eval()
    if out_dir is not None:
        save_drafter(drafter, out_dir)
        with open(Path(out_dir) / "history.jsonl", "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in result.history)
    return result


def _step(drafter: DSparkDrafter, members: list[int], data: list[tuple[torch.Tensor, torch.Tensor]],
          config: TrainConfig, generator: torch.Generator, optimizer: torch.optim.Optimizer, params: list,
          cache: TargetCache | None) -> dict:
    """One optimizer step over the sequences data[members]; returns its metrics (weighted over the
    step's supervised slots)."""
    batch = [data[i] for i in members]
    gamma, noise = drafter.block_size, drafter.config.dspark_noise_token_id
    blocks = [build_blocks(ids, mask, sample_anchors(mask, config.num_anchors, generator), gamma, noise,
                           config.decay) for ids, mask in batch]
    normalizer = float(sum(b.weights.sum() for b in blocks))  # global weighting over the whole step
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    # Sequences go through the target and the drafter `micro_batch` at a time: one ragged call each
    # rather than one per sequence, which is what bounds a small model's step time on a GPU.
    for i in range(0, len(batch), config.micro_batch):
        ids = [seq for seq, _ in batch[i:i + config.micro_batch]]
        group = blocks[i:i + config.micro_batch]
        known = cache.get(members[i:i + config.micro_batch], ids) if cache is not None else None
        loss, metrics = block_losses(drafter, ids, group, config.loss_weights, normalizer, known)
        loss.backward()
        share = float(sum(g.weights.sum() for g in group)) / normalizer
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + share * value
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    totals["grad_norm"] = float(grad_norm)
    return totals
