"""`dspark` command line: `dspark generate "prompt"`."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources

import torch

import dspark
from dspark.tokenizer import ByteTokenizer

RANDOM_TINY = "random-tiny"


def _load(name: str, device: str):
    """A checkpoint directory, or `random-tiny`: the architecture-complete tiny V4 with random weights."""
    if name == RANDOM_TINY:
        config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
        model = dspark.init_model(config, seed=0, device=device)
        model.tokenizer = ByteTokenizer(config["vocab_size"])
        return model
    return dspark.load_model(name, device=device)


def _draft_tokens(text: str):
    return text if text == "auto" else int(text)


def _generate(args) -> int:
    model = _load(args.model, args.device)
    out = dspark.generate(model, args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, draft_tokens=args.draft_tokens)
    print(args.prompt + out.text if out.text is not None else out.token_ids)
    s = out.stats
    print(f"[{s.new_tokens} tokens, {s.rounds} rounds, tau {s.tau:.2f}, "
          f"prefill {s.prefill_s * 1e3:.0f} ms, decode {s.new_tokens / max(s.decode_s, 1e-9):.1f} tok/s, "
          f"finish {out.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("prompt")
    g.add_argument("--model", default=RANDOM_TINY,
                   help=f"checkpoint directory (HF layout), or {RANDOM_TINY} (default until a trained model ships)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--draft-tokens", type=_draft_tokens, default=0)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except ValueError as e:
        parser.exit(2, f"dspark: error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
