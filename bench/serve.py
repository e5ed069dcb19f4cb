"""Load run against `dspark-serve`: throughput, TTFT and inter-token latency percentiles.

Starts the server as a subprocess on 127.0.0.1 (a free port), sends `--requests` streamed
completions with at most `--concurrency` in flight, then stops the server. Every request asks for
token ids (`return_token_ids`), so a chunk's inter-token gap is divided by the tokens it carried
(speculative steps commit several at once), as the server's own ITL histogram does.

    python bench/serve.py                                   # 64 requests, concurrency 8, random-tiny
    python bench/serve.py --draft-tokens 3 --drafter ngram --out bench/results/serve-ngram.json

Bounded: at most `--requests` requests and `--time-limit` seconds of load (requests not started by
then are skipped and counted). Conditions are printed first and stored in the JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the", "model", "drafts", "tokens", "and", "verifies", "them", "in", "one", "pass", "while", "clients",
         "wait", "for", "speculative", "decoding", "is", "exact", "under", "load", "a", "story", "about", "cats")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (EOS may end it sooner)")
    p.add_argument("--prompt-words", default="4,64", help="min,max words per prompt (uniform, seeded)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-tokens", default="0")
    p.add_argument("--drafter", default=None)
    p.add_argument("--server-arg", action="append", default=[], help="extra dspark-serve argument (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds of load before new requests are skipped")
    p.add_argument("--out", default="bench/results/serve.json")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dspark_server", "--model", args.model, "--port", str(port), "--log-level",
           "warning", "--draft-tokens", args.draft_tokens, "--max-tokens", str(max(args.max_tokens, 1)),
           "--max-running", str(max(args.concurrency, 1)), *args.server_arg]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    proc = subprocess.Popen(cmd, cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise SystemExit("server did not become healthy within 180 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    start = time.perf_counter()
    first = last = None
    itl, tokens, spec = [], 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            spec = (chunk.get("metrics") or {}).get("speculative_decoding", spec)
            n = len(chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else 0
            if not n:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                itl += [(now - last) / n] * n
            last, tokens = now, tokens + n
    return {"ok": first is not None, "ttft": first - start if first else None, "e2e": time.perf_counter() - start,
            "tokens": tokens, "itl": itl, "spec": spec}


async def load(args, url: str, prompts: list[str]) -> tuple[list[dict], float, int]:
    semaphore, results, skipped = asyncio.Semaphore(args.concurrency), [], 0
    deadline = time.monotonic() + args.time_limit

    async def run(client, prompt, i):
        nonlocal skipped
        async with semaphore:
            if time.monotonic() > deadline:
                skipped += 1
                return
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "seed": args.seed + i, "stream": True, "return_token_ids": True}
            results.append(await one_request(client, body))

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.time_limit + 60, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(run(client, p, i) for i, p in enumerate(prompts)))
        return results, time.perf_counter() - started, skipped


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"mean": sum(v) / len(v), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": v[-1]}


def summarize(results: list[dict], wall: float, skipped: int) -> dict:
    done = [r for r in results if r["ok"]]
    out_tokens = sum(r["tokens"] for r in done)
    steps = sum(r["spec"]["num_spec_steps"] for r in done if r["spec"])
    committed = sum(r["spec"]["mean_acceptance_length"] * r["spec"]["num_spec_steps"] for r in done if r["spec"])
    drafts = sum(r["spec"]["num_draft_tokens"] for r in done if r["spec"])
    accepted = sum(r["spec"]["num_accepted_draft_tokens"] for r in done if r["spec"])
    return {
        "completed": len(done), "failed": len(results) - len(done), "skipped": skipped, "duration_s": wall,
        "output_tokens": out_tokens, "output_tok_per_s": out_tokens / wall, "requests_per_s": len(done) / wall,
        "ttft_s": percentiles([r["ttft"] for r in done]),
        "itl_s": percentiles([x for r in done for x in r["itl"]]),
        "tpot_s": percentiles([(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]),
        "e2e_s": percentiles([r["e2e"] for r in done]),
        "accept_length_tau": committed / steps if steps else None,
        "draft_acceptance_rate": accepted / drafts if drafts else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    lo, hi = map(int, args.prompt_words.split(","))
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(args.requests)]
    conditions = {
        "bench": "serve", "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "python": platform.python_version(), "torch": importlib.metadata.version("torch"), "model": args.model, "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "prompt_words": [lo, hi],
        "temperature": args.temperature, "draft_tokens": args.draft_tokens, "drafter": args.drafter,
        "server_args": args.server_arg, "server_torch_threads": "as --server-arg says, else dspark-serve's "
                                                              "default (cores - 1 on CPU)", "transport": "HTTP/1.1 SSE on 127.0.0.1, server in a subprocess",
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),  # other work on the machine skews CPU runs
    }
    print("conditions:", json.dumps(conditions), flush=True)
    port = _free_port()
    server = start_server(args, port)
    try:
        results, wall, skipped = asyncio.run(load(args, f"http://127.0.0.1:{port}", prompts))
    finally:
        stop_server(server)
    summary = summarize(results, wall, skipped)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": conditions, "results": summary}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
