"""`dspark target-cache`, `train-draft` and `calibrate-draft`: argparse front ends of `dspark.train`.

    dspark target-cache --model CKPT --prompts prompts.jsonl --out train.jsonl [--max-new-tokens N]
    dspark train-draft --model CKPT --data train.jsonl --out drafter/ [--steps N ...]
    dspark calibrate-draft --model CKPT --drafter drafter/ --prompts heldout.jsonl [--temperature T]
                           [--objective nll|ece|affine]

`target-cache` records the target's own (greedy or sampled) continuations of training prompts;
`train-draft` writes a drafter directory (`dspark.draft.io`), loadable with
`dspark.load_drafter(path, target)`; `calibrate-draft` writes `sts.json` into it (`sts-greedy.json`
at temperature 0). `dspark.cli`
registers them through `add_subcommands`, passing its model loader (checkpoint or `random-tiny`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from dspark.draft.config import HEAD_TYPES, DSparkConfig
from dspark.draft.dspark_v4 import STAGE_KINDS, uses_v41_stages
from dspark.draft.io import GREEDY_STS_FILE, STS_FILE, load_drafter
from dspark.tokenizer import prompt_codec
from dspark.train.calibrate import calibrate_sts
from dspark.verify.sts import OBJECTIVES
from dspark.train.data import parse_record, read_jsonl, self_distill, write_jsonl
from dspark.train.losses import LossWeights
from dspark.train.trainer import TrainConfig, train_draft


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def add_subcommands(sub, load_model: Callable[[str, str], object], default_model: str) -> None:
    """Register `train-draft` and `calibrate-draft`; `load_model(name, device)` builds the target."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = sub.add_parser("train-draft", help="train a DSpark drafter against a frozen target")
    t.add_argument("--model", default=default_model, help="target checkpoint directory, or random-tiny")
    t.add_argument("--data", required=True, help="JSONL: input_ids(+loss_mask) | text | prompt+completion")
    t.add_argument("--out", required=True, help="drafter directory to write")
    t.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="replace the completions by the target's own (N new tokens; spec §5.1)")
    t.add_argument("--init-from", default=None, help="drafter directory to continue from")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=1)
    t.add_argument("--cache-target", action="store_true",
                   help="keep the target's features/logits of each sequence after its first pass (memory!)")
    t.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per target/drafter call (faster on GPUs; same loss to rounding)")
    t.add_argument("--num-anchors", type=int, default=512)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--loss-weights", type=float, nargs=3, default=(0.1, 0.9, 1.0), metavar=("CE", "TV", "CONF"))
    t.add_argument("--decay", type=float, default=None, help="g of exp(-k/g); default 4·γ/7")
    t.add_argument("--max-length", type=int, default=4096)
    t.add_argument("--save-every", type=int, default=0)
    t.add_argument("--seed", type=int, default=42)
    t.add_argument("--block-size", type=int, default=None, help="γ (default 5)")
    t.add_argument("--target-layers", type=_layer_ids, default=None, help="e.g. 40,41,42 (default: last three)")
    t.add_argument("--markov-rank", type=int, default=None)
    t.add_argument("--head-type", choices=HEAD_TYPES, default=None)
    t.add_argument("--noise-token-id", type=int, default=None)
    t.add_argument("--n-routed-experts", type=int, default=None)
    t.add_argument("--n-activated-experts", type=int, default=None)
    t.add_argument("--stage-kind", choices=STAGE_KINDS, default="v4",
                   help="v4: V4 blocks (any DeepSeek target); shipped: the target family's released stage "
                        "modules (V4.1 blocks for a V4.1 target, configured by its own dspark_* fields)")
    t.add_argument("--device", default=device)
    t.set_defaults(run=lambda args: _train(args, load_model))

    r = sub.add_parser("target-cache", help="record the target's own continuations of training prompts")
    r.add_argument("--model", default=default_model, help="target checkpoint directory, or random-tiny")
    r.add_argument("--prompts", required=True, help="JSONL of training prompts (prompt | text | input_ids)")
    r.add_argument("--out", required=True, help="JSONL to write: input_ids + loss_mask, for train-draft --data")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="0 records greedy continuations")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default=device)
    r.set_defaults(run=lambda args: _target_cache(args, load_model))

    c = sub.add_parser("calibrate-draft", help="fit STS confidence temperatures on held-out prompts")
    c.add_argument("--model", default=default_model)
    c.add_argument("--drafter", required=True, help="drafter directory; sts.json is written into it")
    c.add_argument("--prompts", required=True, help="JSONL of held-out prompts (prompt | text | input_ids)")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--temperature", type=float, default=1.0,
                   help="the serving temperature; 0 fits greedy requests' calibration (sts-greedy.json), "
                        "any other value sampled requests' (sts.json)")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--objective", choices=OBJECTIVES, default="nll",
                   help="nll or ece: the paper's STS (a temperature per position); affine: a temperature and "
                        "a bias per position (dspark.verify.sts)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default=device)
    c.set_defaults(run=lambda args: _calibrate(args, load_model))


def _dspark_config(args, target) -> DSparkConfig | None:
    """The new drafter's config from the flags; None (the target's own `dspark_*` fields) for the V4.1
    release's stages, which the flags may not reshape."""
    given = [(flag, name, value) for flag, name, value in (
        ("--block-size", "dspark_block_size", args.block_size),
        ("--target-layers", "dspark_target_layer_ids", args.target_layers),
        ("--markov-rank", "dspark_markov_rank", args.markov_rank),
        ("--head-type", "dspark_markov_head_type", args.head_type),
        ("--noise-token-id", "dspark_noise_token_id", args.noise_token_id),
        ("--n-routed-experts", "dspark_n_routed_experts", args.n_routed_experts),
        ("--n-activated-experts", "dspark_n_activated_experts", args.n_activated_experts)) if value is not None]
    if uses_v41_stages(target.config, args.stage_kind):
        if given:
            raise ValueError(f"--stage-kind shipped trains the V4.1 release's stages as the target's dspark_* "
                             f"fields configure them; drop {', '.join(flag for flag, _, _ in given)}")
        return None
    return DSparkConfig.for_target(target.config, **{name: value for _, name, value in given})


def read_prompts(path: str, model) -> list[list[int]]:
    """Prompt ids of a JSONL file for `model`: the prompt of prompt+completion records, else the
    whole record (text encoded as `model`'s prompts are, `dspark.tokenizer.prompt_codec`)."""
    codec = prompt_codec(model)
    prompts = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if "prompt" in record and "completion" not in record and "response" not in record:
                    record = {**record, "completion": []}
                seq = parse_record(record, codec, f"{path}:{i}")
                prompts.append([t for t, m in zip(seq.input_ids, seq.loss_mask) if m == 0] or list(seq.input_ids))
    return prompts


def _train(args, load_model) -> int:
    target = load_model(args.model, args.device)
    if args.regenerate:
        data = self_distill(target, read_prompts(args.data, target), args.regenerate, seed=args.seed)
    else:
        data = read_jsonl(args.data, target.tokenizer, target.config.vocab_size)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors, lr=args.lr,
                         weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip,
                         loss_weights=LossWeights(*args.loss_weights), decay=args.decay, max_length=args.max_length,
                         seed=args.seed, save_every=args.save_every,
                         micro_batch=args.micro_batch, cache_target=args.cache_target)
    drafter = load_drafter(args.init_from, target, dtype=torch.float32) if args.init_from else None
    result = train_draft(target, data, config, drafter=drafter,
                         dspark_config=None if drafter else _dspark_config(args, target), out_dir=args.out,
                         stage_kind=args.stage_kind)
    last = result.history[-1]
    print(f"[{len(result.history)} steps, loss {last['loss']:.4f}, analytic tau {last['tau']:.2f}; "
          f"drafter written to {args.out}]", file=sys.stderr)
    return 0


def _target_cache(args, load_model) -> int:
    """The paper's data step (spec §5.1): prompt + the target's own continuation, masked to the latter."""
    target = load_model(args.model, args.device)
    data = self_distill(target, read_prompts(args.prompts, target), args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    write_jsonl(data, args.out)
    print(f"[{len(data)} sequences, {sum(sum(s.loss_mask) for s in data)} target tokens written to {args.out}]",
          file=sys.stderr)
    return 0


def _calibrate(args, load_model) -> int:
    target = load_model(args.model, args.device)
    drafter = load_drafter(args.drafter, target)
    cal = calibrate_sts(target, drafter, read_prompts(args.prompts, target), args.max_new_tokens,
                        args.temperature, args.top_p, args.seed, args.objective, dataset=args.prompts)
    name = GREEDY_STS_FILE if args.temperature == 0 else STS_FILE
    cal.save(f"{args.drafter}/{name}")
    biases = f"; biases {', '.join(f'{b:.3f}' for b in cal.biases)}" if cal.biases else ""
    print(f"[{name}: {cal.num_samples} rounds; temperatures {', '.join(f'{t:.3f}' for t in cal.temperatures)}"
          f"{biases}; ECE {sum(cal.ece_before) / cal.gamma:.4f} -> {sum(cal.ece_after) / cal.gamma:.4f}]",
          file=sys.stderr)
    return 0
