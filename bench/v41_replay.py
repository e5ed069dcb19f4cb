"""DeepSeek-V4.1 bounded replay vs exact prefill on the tiny config, on the CPU (deepseek_v41 spec §6.2).

Two measurements with one random-weight tiny model (`dspark/configs/tiny-v41.json`, window W = 8,
split layer 4 of 7; default numerics, cache QAT on), both modes chosen per call on the same weights:

* drift: for each prompt length P and seed, prefill the prompt in each mode, then decode greedily
  `--new-tokens` tokens in the same mode (decode calls are identical in both modes). Reported:
  max |Δ logit| of the first new token, greedy agreement (share of equal tokens position by position
  and the length of the common prefix), and under teacher forcing (both fed exact mode's tokens)
  the max |Δ logit| over all decode steps and at the last one (how fast the drift fades as the
  window moves past the replayed rows). P <= W is the control: bounded replay is exact there.
* speed: wall time of prefilling one `--speed-prompt`-token prompt, as one call and in chunks of
  `--chunk` (what `generate` does), best of `--repeats` runs, modes interleaved; speedup = exact /
  bounded.

    python bench/v41_replay.py                      # JSON to stdout and bench/results/v41_replay.json
    python bench/v41_replay.py --prompt-lens 8,64 --seeds 0 --speed-prompt 1024 --repeats 1   # quick

Conditions (CPU, threads, load average, torch version, commit) are part of the JSON. On a shared
machine the load average matters: timings are the minimum over repeats for that reason, on one
intra-op thread by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import resources
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

import dspark  # noqa: E402  (after the path fix)
from provenance import git_commit  # noqa: E402

EXACT, BOUNDED = "exact", "bounded_replay"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-lens", default="8,64,256,1024", help="drift: prompt lengths")
    p.add_argument("--seeds", default="0,1,2", help="drift: prompt (and weight) seeds")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--speed-prompt", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="speed: chunk size of the chunked prefill")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="speed: intra-op threads (drift always runs on 1: tiny ops). More than 1 on a machine "
                        "shared with other jobs makes OpenMP spin-waits dominate and the timings erratic")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "v41_replay.json"))
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    return args


def conditions(args) -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": {"drift": 1, "speed": args.threads},
            "load_average_1_5_15": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version(),
            "commit": args.commit or git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "config": "dspark/configs/tiny-v41.json", "dtype": "float32", "cache_qat": True}


def tiny_model(seed: int):
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v41.json").read_text())
    return dspark.init_model(config, seed=seed, prefill_mode=EXACT)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1000 + seed))


def greedy(model, ids: torch.Tensor, mode: str, new_tokens: int):
    """Prefill in `mode`, then greedy decode; returns (first-token logits [V], tokens, state)."""
    state = model.new_state()
    logits = model(ids, [state], [len(ids)], prefill_mode=mode).logits[-1]
    first, tokens = logits, [int(logits.argmax())]
    for _ in range(new_tokens - 1):
        logits = model(torch.tensor(tokens[-1:]), [state], [1], prefill_mode=mode).logits[-1]
        tokens.append(int(logits.argmax()))
    return first, tokens


def teacher_forced(model, ids: torch.Tensor, tokens: list[int]) -> list[float]:
    """max |Δ logit| per decode step when both modes are fed the same (exact mode's) tokens."""
    states = {mode: model.new_state() for mode in (EXACT, BOUNDED)}
    last = {mode: model(ids, [s], [len(ids)], prefill_mode=mode).logits[-1] for mode, s in states.items()}
    deltas = [(last[EXACT] - last[BOUNDED]).abs().max().item()]
    for token in tokens[:-1]:
        step = {mode: model(torch.tensor([token]), [s], [1]).logits[-1] for mode, s in states.items()}
        deltas.append((step[EXACT] - step[BOUNDED]).abs().max().item())
    return deltas


def drift(args) -> list[dict]:
    rows = []
    for seed in args.seeds:
        model = tiny_model(seed)
        for n in args.prompt_lens:
            ids = prompt(n, seed)
            first_e, tok_e = greedy(model, ids, EXACT, args.new_tokens)
            first_b, tok_b = greedy(model, ids, BOUNDED, args.new_tokens)
            common = next((i for i, (a, b) in enumerate(zip(tok_e, tok_b)) if a != b), len(tok_e))
            forced = teacher_forced(model, ids, tok_e)
            rows.append({"seed": seed, "prompt": n, "first_token_max_dlogit": (first_e - first_b).abs().max().item(),
                         "greedy_agreement": sum(a == b for a, b in zip(tok_e, tok_b)) / len(tok_e),
                         "greedy_common_prefix": common, "forced_max_dlogit": max(forced),
                         "forced_last_dlogit": forced[-1],
                         "forced_steps_until_exact": next((i for i, d in enumerate(forced) if all(
                             x == 0 for x in forced[i:])), None)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def timed(model, ids: torch.Tensor, mode: str, chunk: int) -> float:
    state = model.new_state()
    start = time.perf_counter()
    for lo in range(0, len(ids), chunk):
        piece = ids[lo:lo + chunk]
        model(piece, [state], [len(piece)], prefill_mode=mode)
    return time.perf_counter() - start


def speed(args) -> list[dict]:
    model, ids = tiny_model(0), prompt(args.speed_prompt, 0)
    timed(model, ids[:256], EXACT, 256)  # warm-up (allocator, first-call overheads)
    rows = []
    for chunk in (args.speed_prompt, args.chunk):
        times = {EXACT: [], BOUNDED: []}
        for _ in range(args.repeats):
            for mode in (EXACT, BOUNDED):
                times[mode].append(timed(model, ids, mode, chunk))
        best = {mode: min(t) for mode, t in times.items()}
        rows.append({"prompt": args.speed_prompt, "chunk": chunk, "exact_s": best[EXACT],
                     "bounded_replay_s": best[BOUNDED], "speedup": best[EXACT] / best[BOUNDED],
                     "all_exact_s": times[EXACT], "all_bounded_replay_s": times[BOUNDED]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {"conditions": conditions(args), "args": {k: v for k, v in vars(args).items() if k != "out"}}
    with torch.inference_mode():
        # One-token decode steps are far too small for intra-op threads (OpenMP spinning costs more).
        torch.set_num_threads(1)
        result["drift"] = drift(args)
        torch.set_num_threads(args.threads)
        result["speed"] = speed(args)
    result["conditions"]["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
