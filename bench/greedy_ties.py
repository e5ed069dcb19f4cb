"""Where greedy speculative decoding leaves plain greedy decoding on a low-precision target, and why.

    python -m dspark.models.hf_causal.gguf --gemma --out models/gemma-3-270m      # once
    OMP_NUM_THREADS=1 python bench/greedy_ties.py --model models/gemma-3-270m --dtype bfloat16 \
        --out bench/results/greedy-ties-gemma-bf16-cpu.json

Decodes the first `--limit` prompts of a shipped prompt set greedily at batch 1, plain and with the
n-gram drafter (γ = 7, every draft verified), and for each prompt whose outputs differ records the
first split and plain decoding's top-2 logit margin there, recomputed by one forward over the whole
prefix. A margin of zero or of one unit in the last place of the logits' dtype means a tie that a
call over a different number of rows (a verify block against a one-token step) rounds the other way;
a large margin would mean a bug.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import dspark
from dspark.draft import NgramDrafter
from dspark.evaluate import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_gemma import encode_prompt, greedy_splits, measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", default="mt-bench")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompt-format", default="qa")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=980406)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = dspark.load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    prompts = [encode_prompt(model, t, args.prompt_format) for t in load_prompts(args.set)[: args.limit]]
    t0 = time.perf_counter()
    _, plain = measure(model, prompts, 0.0, args.max_new_tokens, None, 0, args.seed)
    _, ngram = measure(model, prompts, 0.0, args.max_new_tokens, NgramDrafter(block_size=7), 7, args.seed)
    splits = greedy_splits(model, prompts, plain, ngram)
    result = {"conditions": {**vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
                             "python": platform.python_version(), "command": " ".join(["python"] + sys.argv)},
              "prompts": len(prompts), "tokens_per_prompt": [len(o) for o in plain], "splits": splits,
              "logits_dtype_ulp_at_16": float(torch.finfo(getattr(torch, args.dtype)).eps * 16),
              "seconds": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(splits), flush=True)


if __name__ == "__main__":
    main()
