"""`dspark-serve`: parse arguments → load the model → `Engine` → `create_app` → uvicorn."""

from __future__ import annotations

import argparse
import logging
import os

import torch
import uvicorn

import dspark
from dspark.draft import DRAFTER_NAMES
from dspark.engine import Engine, EngineConfig
from dspark.verify.capacity import CapacityTable
from dspark.validate import PLANNERS

from .app import create_app

from dspark.api import RANDOM_TINY
_DEFAULTS = EngineConfig()


def load_model(name: str, device: str):
    """`tiny` (the embedded trained model), `random-tiny` or a checkpoint directory."""
    return dspark.load_model(name, device=device)


def _draft_tokens(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'auto', got {text!r}") from None


def _torch_threads(requested: int | None, device: str) -> int | None:
    """Intra-op threads for CPU inference. The engine steps in one thread while the event loop (HTTP,
    tokenization, detokenization) runs in another; if torch's pool takes every core, each op waits
    on a pool thread the event loop preempted. Measured with bench/serve.py on 2 cores: 6.5 tok/s
    with torch's default of 2 threads, 265 tok/s with 1. So on CPU the default leaves one core free."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {requested}")
        return requested
    return max(1, (os.cpu_count() or 1) - 1) if device.split(":")[0] == "cpu" else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-serve", description="OpenAI-compatible server for dspark models.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help=f"tiny (the embedded trained model, default), a checkpoint directory, or {RANDOM_TINY}")
    p.add_argument("--served-model-name", default=None, help="id clients pass as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to listen on every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads; default on CPU: one less than the cores (see _torch_threads)")
    p.add_argument("--drafter", choices=DRAFTER_NAMES, default=None,
                   help="default: the best the model offers (DSpark stages, else MTP, else n-gram)")
    p.add_argument("--draft-tokens", type=_draft_tokens, default=0,
                   help="drafts verified per round: 0 (plain decoding), n, or auto (confidence-scheduled)")
    p.add_argument("--planner", choices=PLANNERS, default=_DEFAULTS.planner)
    p.add_argument("--max-running", type=int, default=_DEFAULTS.max_running, help="requests decoded together")
    p.add_argument("--max-waiting", type=int, default=_DEFAULTS.max_waiting, help="queued requests; more get 429")
    p.add_argument("--max-prompt-tokens", type=int, default=_DEFAULTS.max_prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=_DEFAULTS.max_new_tokens, help="max new tokens per request")
    p.add_argument("--prefill-chunk", type=int, default=_DEFAULTS.prefill_chunk)
    p.add_argument("--capacity", default=None,
                   help="capacity table JSON from `dspark profile`, or a shipped name (e.g. h200-v4-mini-ctx4k), for --draft-tokens auto (default: the drafter's table for this device type, e.g. dspark-tiny's for CPUs, "
                        "else a synthetic CPU table)")
    p.add_argument("--capacity-sampled", default=None,
                   help="capacity table for rounds with a sampled request (`dspark profile --engine --temperature 1`; "
                        "default: --capacity when given, else the drafter's sampled table for this device, its card's where it ships one)")
    p.add_argument("--static-decode", choices=("auto", "on", "off"), default="auto",
                   help="decoding rounds on static slots with CUDA graphs; auto: on for a DeepSeek-V4/V4.1 "
                        "model on CUDA that can replay them (EngineConfig.static_decode=None)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="keep one plain greedy decode step in flight while the host commits the last one; "
                        "auto: wherever the static path runs (EngineConfig.overlap=None)")
    p.add_argument("--state-budget-bytes", type=int, default=None,
                   help="device memory for per-request decode state; the newest requests are preempted "
                        "(and recomputed) when it runs out (default: enough for --max-running at their longest)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight may finish after a shutdown signal before being aborted")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def engine_config(args) -> EngineConfig:
    """The engine's configuration from parsed arguments (tables loaded: a bad path raises here)."""
    return EngineConfig(max_running=args.max_running, max_waiting=args.max_waiting,
                        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_tokens,
                        prefill_chunk=args.prefill_chunk, draft_tokens=args.draft_tokens,
                        drafter=args.drafter, planner=args.planner,
                        capacity=CapacityTable.load(args.capacity) if args.capacity else None,
                        capacity_sampled=CapacityTable.load(args.capacity_sampled) if args.capacity_sampled else None,
                        state_budget_bytes=args.state_budget_bytes,
                        static_decode={"auto": None, "on": True, "off": False}[args.static_decode],
                        overlap={"auto": None, "on": True, "off": False}[args.overlap])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        threads = _torch_threads(args.torch_threads, args.device)
        if threads is not None:
            torch.set_num_threads(threads)
        engine = Engine(load_model(args.model, args.device), engine_config(args))
        app = create_app(engine, model_name=args.served_model_name or args.model, api_key=args.api_key,
                         drain_s=args.drain_timeout, max_body_bytes=args.max_body_bytes)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad model path, device or limits
        parser.exit(2, f"dspark-serve: error: {e}\n")
    # uvicorn stops waiting for open connections a little after the engine's own drain deadline.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout + 5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
