"""How fast the service stack delivers tokens, with a fake engine that emits them as fast as it can.

Starts `python -m conveyor.testing.serve api_server` (tokenizer, the fake engine of
conveyor.testing.fake_engine, detokenizer and ingress processes over ipc://), opens C concurrent
streaming chat completions for C in --concurrency, and reports: streamed tokens/s delivered to
the clients, the rate the fake engine produced, time to first token, and each stage's busy time
per token (from the stages' own counters).
If delivered ≈ produced, the stack keeps up with the engine; a real GPU engine produces far
fewer tokens per second than the fake one, so this bounds what the pipeline can carry.

    python benchmarks/stack_throughput.py --concurrency 1 64 256 --tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conveyor.testing.serve import FAKE_ENGINE
from conveyor.testing.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {metric{labels}: value}."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def one_stream(http: httpx.AsyncClient, model: str, tokens: int) -> tuple[float, int, float]:
    """(time to first token, tokens received, end time) for one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, count = None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - start
    return first or 0.0, count, time.perf_counter()


async def run_level(url: str, model: str, concurrency: int, tokens: int, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await one_stream(http, model, 8)  # warm-up
        await asyncio.sleep(1.2)  # stage counters travel on the 0.5 s ring ping: let one pass
        before = scrape(url)
        start = time.perf_counter()
        results = []
        for _ in range(rounds):
            results += await asyncio.gather(*(one_stream(http, model, tokens) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        await asyncio.sleep(1.2)
        after = scrape(url)
    delivered = sum(r[1] for r in results)
    produced = after["conveyor_engine_generated_tokens"] - before["conveyor_engine_generated_tokens"]  # = delivered

    def delta(stat: str) -> float:
        key = f'conveyor_stage_stat{{stat="{stat}"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)

    ttfts = sorted(r[0] * 1000 for r in results)
    per_tok_us = lambda s: 1e6 * delta(s) / max(delivered, 1)
    return {
        "concurrency": concurrency, "requests": len(results), "tokens_per_request": tokens,
        "wall_s": round(wall, 3),
        "delivered_tok_s": round(delivered / wall, 1),
        "engine_produced_tok_s": round(produced / wall, 1),
        "ttft_ms_mean": round(statistics.mean(ttfts), 2),
        "ttft_ms_p99": round(ttfts[max(math.ceil(0.99 * len(ttfts)) - 1, 0)], 2),  # nearest rank
        "engine_busy_us_per_token": round(per_tok_us("engine_busy_s"), 2),
        # What the fake engine could produce if nothing downstream held it back.
        "engine_capacity_tok_s": round(delivered / max(delta("engine_busy_s"), 1e-9), 1),
        "detokenizer_busy_us_per_token": round(per_tok_us("detokenizer_busy_s"), 2),
        "tokenizer_busy_ms_per_request": round(1e3 * delta("tokenizer_busy_s") / max(len(results), 1), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir for the tokenizer (default: SmolLM2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="batches of C requests per level")
    parser.add_argument("--tokenizer-workers", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "stack_throughput.json")
    args = parser.parse_args()
    from conveyor.default_model import fetch

    model_dir = args.model or str(fetch())
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    srv = ServerProcess(model_dir, "--max-batch-size", "1024", "--session-len", "8192",
                        "--tokenizer-workers", str(args.tokenizer_workers), "--log-level", "WARNING",
                        log_dir=log_dir, engine_factory=FAKE_ENGINE)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    records = []
    try:
        model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        for c in args.concurrency:
            rec = asyncio.run(run_level(srv.url, model, c, args.tokens, args.rounds))
            rec.update(engine="conveyor-stack(fake engine)", gpu=None, model="fake", precision=None,
                       benchmark="stack_throughput", batch=c, input_len=None, output_len=args.tokens,
                       out_tok_s=rec["delivered_tok_s"], ttft_ms=rec["ttft_ms_mean"], req_s=None, commit=commit,
                       command="python " + " ".join(sys.argv), machine=f"{platform.machine()} x{os.cpu_count()} CPUs")
            records.append(rec)
            print(json.dumps({k: rec[k] for k in ("concurrency", "delivered_tok_s", "engine_capacity_tok_s",
                                                  "ttft_ms_mean", "ttft_ms_p99", "engine_busy_us_per_token",
                                                  "detokenizer_busy_us_per_token",
                                                  "tokenizer_busy_ms_per_request")}), flush=True)
    finally:
        srv.terminate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
