"""Cross-layer mHC fusion on one GPU: whole-model step time with each block boundary as one op.

The models run a block's closing mHC post and the next block's first pre as one fused op
(`mhc_post_pre` in V4, `mhc_v41_post_pre` in V4.1; 2 mHC ops per layer + 1). This script times
that against the wiring before it, every boundary a standalone post and then a standalone pre
(3 ops per layer), patched in here for the run (the library has no switch for it), on the same
model instance: v4-mini and v41-mini (dspark/configs), random bf16 weights, Triton kernels.

Per family and batch (1 and 8 requests): one prefill of `--prompt` tokens per request, then
`--steps` greedy decode steps; median decode-step and prefill time by CUDA events (one warm-up
pass first). The "closed" run decodes the fused run's tokens (teacher forcing), so every call's
logits are comparable; `rel_err` = max over calls of ‖Δ‖/‖fused‖ (rounding only: the fused
op computes the next site's statistics from the stored, rounded streams, as the unfused pre does).

    OUT=/tmp/out python bench/mhc_boundaries.py            # JSON to $OUT/mhc_boundaries.json
    python bench/mhc_boundaries.py --families v4-mini --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

FAMILIES = ("v4-mini", "v41-mini")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {FAMILIES}")
    p.add_argument("--batches", default="1,8", help="comma list of requests per call")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/mhc_boundaries.json, else bench/results/)")
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
    if args.prompt < 1 or args.steps < 1 or not args.batches or min(args.batches) < 1:
        p.error("--prompt, --steps and every batch must be >= 1")
    return args


@contextlib.contextmanager
def closed_boundaries(family: str):
    """Inside: every block boundary runs as the previous block's standalone post, then this
    block's standalone pre (the wiring before the cross-layer fusion)."""
    if family == "v4-mini":
        from dspark.models.deepseek_v4.model import Block

        def enter(self, pending, y):
            x = self.post_op(pending.f, y, pending.post, pending.comb)
            return x, self.attn_site(x)

        owner, name, patched = Block, "enter", enter
    else:
        from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM

        owner, name = DeepseekV41ForCausalLM, "_materialised_inputs"
        patched = lambda self, replay: frozenset(range(len(self.layers)))  # noqa: E731
    original = getattr(owner, name)
    setattr(owner, name, patched)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run(model, prompt: torch.Tensor, batch: int, steps: int, forced: list[torch.Tensor] | None):
    """Prefill + `steps` decode calls (greedy, or the `forced` tokens); returns (prefill_s,
    median step_s, logits per call, tokens fed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(*call):
        start.record()
        out = model(*call)
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) * 1e-3

    states = [model.new_state() for _ in range(batch)]
    out, prefill_s = timed(prompt, states, [len(prompt) // batch] * batch)
    last = out.logits[len(prompt) // batch - 1::len(prompt) // batch]
    logits, tokens, step_s = [last], [], []
    for i in range(steps):
        nxt = last.argmax(-1) if forced is None else forced[i]
        tokens.append(nxt)
        out, dt = timed(nxt, states, [1] * batch)
        last = out.logits
        logits.append(last)
        step_s.append(dt)
    return prefill_s, statistics.median(step_s), logits, tokens


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def family_rows(family: str, args: argparse.Namespace) -> list[dict]:
    from dspark.api import init_model
    from dspark.kernels import KernelConfig

    model = init_model(family, seed=0, device="cuda", dtype=torch.bfloat16, kernels=KernelConfig.uniform("triton"))
    vocab = model.config.vocab_size
    rows = []
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(2, vocab, (batch * args.prompt,), generator=gen).cuda()
        result = {}
        for wiring in ("fused", "closed"):
            ctx = closed_boundaries(family) if wiring == "closed" else contextlib.nullcontext()
            forced = result["fused"][3] if wiring == "closed" else None
            with ctx:
                run(model, prompt, batch, 2, None if forced is None else forced[:2])  # warm-up: compiles every shape class
                result[wiring] = run(model, prompt, batch, args.steps, forced)
        (f_pre, f_step, f_logits, _), (c_pre, c_step, c_logits, _) = result["fused"], result["closed"]
        err = max(rel_err(c.float(), f.float()) for f, c in zip(f_logits, c_logits))
        rows.append({"family": family, "batch": batch, "prompt": args.prompt, "steps": args.steps,
                     "decode_fused_us": f_step * 1e6, "decode_closed_us": c_step * 1e6,
                     "decode_speedup": c_step / f_step, "prefill_fused_us": f_pre * 1e6,
                     "prefill_closed_us": c_pre * 1e6, "prefill_speedup": c_pre / f_pre, "rel_err": err})
        print(json.dumps(rows[-1]), flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/mhc_boundaries.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.kernels import conditions
    from provenance import git_commit

    cond, start = conditions(git_commit()), time.time()
    rows = [row for family in args.families for row in family_rows(family, args)]
    out = Path(args.out or Path(os.environ.get("OUT", REPO / "bench/results")) / "mhc_boundaries.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "args": vars(args), "results": rows}, indent=1))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
