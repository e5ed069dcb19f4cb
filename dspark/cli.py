"""`dspark` command line: `dspark generate "prompt"`, `dspark eval-accept --out DIR`, `dspark profile --out FILE`."""

from __future__ import annotations

import argparse
import sys

import torch

import dspark

from dspark.api import RANDOM_TINY


def _load(name: str, device: str):
    """`tiny`, `random-tiny` or a checkpoint directory (`dspark.load_model`)."""
    return dspark.load_model(name, device=device)


def _draft_tokens(text: str):
    return text if text == "auto" else int(text)


def _threads(text: str) -> int:
    """--threads: a positive int (torch.set_num_threads raises an opaque RuntimeError otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _generate(args) -> int:
    if args.ep > 1 or args.tp > 1:  # one rank of a torchrun launch
        from dspark.distributed.launch import generate_distributed

        return generate_distributed(args)
    if len(args.prompt) != 1:
        raise ValueError(f"{len(args.prompt)} prompts given: several prompts need --ep or --tp (a parallel run)")
    if args.engram_shard:
        raise ValueError("--engram-shard needs --ep or --tp above 1 (ranks to shard the Engram tables over)")
    args.prompt = args.prompt[0]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # process-wide, set here at the edge only
    from dspark.verify.capacity import CapacityTable

    capacity = CapacityTable.load(args.capacity) if args.capacity else None
    model = _load(args.model, args.device)
    if args.draft_tokens is None:  # speculative by default where the model ships its own DSpark drafter
        args.draft_tokens = "auto" if getattr(model, "dspark", None) is not None else 0
    out = dspark.generate(model, args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, draft_tokens=args.draft_tokens, drafter=args.drafter,
                          planner=args.planner, capacity=capacity)
    print(args.prompt + out.text if out.text is not None else out.token_ids)
    s = out.stats
    print(f"[{s.new_tokens} tokens, {s.rounds} rounds, tau {s.tau:.2f}, "
          f"prefill {s.prefill_s * 1e3:.0f} ms, decode {s.new_tokens / max(s.decode_s, 1e-9):.1f} tok/s, "
          f"finish {out.finish_reason}]", file=sys.stderr)
    return 0


def _eval_accept(args) -> int:
    from dspark.evaluate import EvalConfig, eval_accept, load_eval_model  # only this subcommand needs it
    from dspark.verify.capacity import CapacityTable

    config = EvalConfig(tuple(d.strip() for d in args.dataset.split(",") if d.strip()), args.limit,
                        args.temperature, args.budget, args.drafter, args.max_new_tokens, args.concurrency,
                        args.seed, args.planner, args.data_dir)
    capacity = CapacityTable.load(args.capacity) if args.capacity else None
    summary = eval_accept(load_eval_model(args.model, args.device), config, args.out, model_name=args.model,
                          capacity=capacity, progress=True)
    for row in summary.get("domains", []):
        survival = " ".join("-" if x is None else f"{x:.2f}" for x in row["accept_rate_at_k"])
        print(f"{row['domain']:>14}  tau {row['tau']:.3f}  rounds {row['rounds']:>6}  accept_rate@k {survival}")
    print(f"wrote {args.out}/traces.jsonl and {args.out}/summary.json", file=sys.stderr)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _profile(args) -> int:
    from dspark.draft import resolve_drafter  # only this subcommand needs these
    from dspark.engine.round_profile import RoundProfileConfig, profile_rounds
    from dspark.profile import ProfileConfig, profile_capacity

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.engine and not args.drafter:
        raise SystemExit("dspark profile --engine needs --drafter: it times the engine's drafting rounds")
    if args.temperature and not args.engine:
        raise SystemExit(f"dspark profile --temperature {args.temperature:g} needs --engine: bare forwards "
                         f"do not sample")
    if args.auto_rounds and not args.engine:
        raise SystemExit("dspark profile --auto-rounds needs --engine: it times engine rounds")
    config = (RoundProfileConfig(args.requests, args.budgets, args.context, args.warmup, args.steps,
                                 temperature=args.temperature, auto_rounds=args.auto_rounds) if args.engine
              else ProfileConfig(args.batch_tokens, args.context, args.width, args.warmup, args.repeats,
                                 args.prefill_chunk, plain=not args.no_plain))
    model = _load(args.model, args.device)
    drafter = resolve_drafter(model, args.drafter) if args.drafter else None
    if args.engine:
        table = profile_rounds(model, drafter, config, model_name=args.model, drafter_name=args.drafter,
                               progress=lambda r, n, s: print(f"R={r:>4} n={n}  {s * 1e3:9.3f} ms per round",
                                                              file=sys.stderr))
    else:
        table = profile_capacity(model, config, model_name=args.model,
                                 progress=lambda b, s, what: print(
                                     f"{what}={b:>6}  {s * 1e3:9.3f} ms  {1 / s:9.1f} steps/s", file=sys.stderr),
                                 drafter=drafter, drafter_name=args.drafter or "")
    table.save(args.out)
    print(f"wrote {args.out} ({table.label})", file=sys.stderr)
    return 0


def _add_profile(sub) -> None:
    from dspark.profile import ProfileConfig

    d = ProfileConfig()
    p = sub.add_parser("profile", help="measure SPS(B) (target steps/s vs tokens per step) and write the "
                                       "capacity table the planner reads (--capacity)")
    p.add_argument("--model", default="tiny", help=f"tiny, a checkpoint directory, or {RANDOM_TINY}")
    p.add_argument("--batch-tokens", type=_int_list, default=d.batch_tokens, help="probe sizes B, e.g. 1,2,4,8")
    p.add_argument("--context", type=int, default=d.context, help="tokens of state per request during probes")
    p.add_argument("--width", type=int, default=d.width, help="tokens verified per request (1 + drafts)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk)
    p.add_argument("--no-plain", action="store_true",
                   help="skip the plain steps (one token per request), the curve budget 0 is priced by")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=_threads, default=1, help="CPU threads for torch")
    p.add_argument("--drafter", default=None, choices=("dspark", "mtp"),
                   help="also time this drafter's propose in every width probe: the table prices drafting "
                        "rounds against plain ones (what --draft-tokens auto needs to skip drafting)")
    p.add_argument("--engine", action="store_true",
                   help="time the engine's own rounds instead of bare forwards: an engine at each fixed budget "
                        "(--budgets, 0 = plain) serving each load (--requests) of --context-token prompts, "
                        "graphs and the round in flight included where the engine runs them (needs --drafter)")
    p.add_argument("--requests", type=_int_list, default=(1, 2, 4, 8), help="--engine: loads R")
    p.add_argument("--budgets", type=_int_list, default=None, help="--engine: fixed budgets (default 0..γ)")
    p.add_argument("--steps", type=int, default=24, help="--engine: timed decoding steps per load and budget")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="--engine: time requests sampled at this temperature (0: greedy): the table of sampled "
                        "rounds, shipped beside a drafter as capacity-<device>-sampled.json")
    p.add_argument("--auto-rounds", action="store_true",
                   help="--engine: time each drafting budget n as the \"auto\" planner runs it (an auto engine held at "
                        "n: the whole block drafted in a synchronous round, n or n + 1 slots in flight) instead of an "
                        "engine at the fixed budget n")
    p.add_argument("--out", required=True, help="capacity table JSON to write")
    p.set_defaults(run=_profile)


def _add_eval_accept(sub) -> None:
    from dspark.evaluate import DEFAULT_DATASETS, DEFAULT_SEED, parse_budget

    e = sub.add_parser("eval-accept", help="acceptance-rate evaluation on prompt sets (traces + summary)")
    e.add_argument("--model", default=RANDOM_TINY, help=f"checkpoint directory, or {RANDOM_TINY}")
    e.add_argument("--dataset", default=",".join(DEFAULT_DATASETS),
                   help="comma-separated prompt sets (gsm8k, math500, humaneval, mbpp, mt-bench, arena-hard-v2)")
    e.add_argument("--data-dir", default=None,
                   help="folder of <set>.jsonl files (default: the 20-prompt subsets shipped with dspark; "
                        "../shared/data/eval holds the full sets)")
    e.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--budget", type=parse_budget, default="all", help="all (verify γ), auto (planner) or n")
    e.add_argument("--drafter", default="ngram", help="ngram, mtp or dspark")
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    e.add_argument("--seed", type=int, default=DEFAULT_SEED)
    e.add_argument("--planner", default="sync", help="sync or async (with --budget auto)")
    e.add_argument("--capacity", default=None, help="capacity table JSON or shipped name (e.g. h200-v4-mini-ctx4k) for --budget auto (default: the drafter's table for this device type, else a synthetic CPU table)")
    e.add_argument("--out", required=True, help="output folder for traces.jsonl and summary.json")
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.set_defaults(run=_eval_accept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("prompt", nargs="+", help="prompt (several only with --ep/--tp: one request each)")
    g.add_argument("--model", default="tiny",
                   help=f"tiny (the embedded trained model, default), a checkpoint directory, or {RANDOM_TINY}")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--draft-tokens", type=_draft_tokens, default=None,
                   help="0 (plain), n (verify n drafts a round) or auto (the planner; default when the model "
                        "ships a DSpark drafter, as dspark-tiny does, else 0; 0 with --ep/--tp)")
    g.add_argument("--drafter", default=None, help="dspark, mtp or ngram (default: the model's best)")
    g.add_argument("--planner", default="async", help="async (default) or sync (with --draft-tokens auto)")
    g.add_argument("--capacity", default=None,
                   help="capacity table JSON from `dspark profile`, or a shipped name (e.g. h200-v4-mini-ctx4k), for --draft-tokens auto (default: the drafter's table for this device type, e.g. dspark-tiny's for CPUs, "
                        "else a synthetic CPU table)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--threads", type=_threads, default=1,
                   help="CPU threads for torch (default 1: the small models here lose time to thread hand-offs)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree (= torchrun's world size): each rank builds and reads only "
                        "its E/ep routed experts")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (= torchrun's world size), for small decode batches: attention "
                        "split by output group (query heads, wo_a/wo_b; the KV latent replicated) and every expert "
                        "split along its width, one all-reduce after each; each rank reads only its slices "
                        "of the weights")
    g.add_argument("--dp-attention", action="store_true", help="with --ep: each rank serves its own requests")
    g.add_argument("--tp-epilogue", default="auto", choices=("auto", "fused", "ref"),
                   help="with --tp: the MoE epilogue, fused on GPUs when possible (auto), always (fused) "
                        "or never (ref)")
    g.add_argument("--engram-shard", action="store_true",
                   help="with --ep/--tp, DeepSeek-V4.1: each rank holds and reads 1/world_size of the rows of "
                        "every Engram table instead of a whole copy; lookups cross the ranks")
    g.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo", help="nccl or gloo")
    g.set_defaults(run=_generate)
    _add_eval_accept(sub)
    _add_profile(sub)
    from dspark.train.cli import add_subcommands  # target-cache, train-draft, calibrate-draft: imported on use
    add_subcommands(sub, _load, RANDOM_TINY)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:  # bad arguments, missing model or table files
        parser.exit(2, f"dspark: error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
