"""Served request throughput: LMDeploy's profile_restful_api against a running OpenAI-compatible server.

The workload is profile_throughput's, so that served and offline runs do the same work: each
line of a ``{"input_len", "output_len"}`` jsonl file (default ``benchmarks/data/
sharegpt_shape_3000.jsonl``) becomes a prompt of random token ids drawn exactly as
profile_throughput draws them (``random.Random(seed)``, ids in [100, vocab)), sent to
``/v1/completions`` with ``max_tokens = output_len``, ``ignore_eos`` and temperature 0. A
ShareGPT ``.json`` file (LMDeploy's dataset) is sent as text to ``/v1/chat/completions``, its
first human turn the prompt and the reply's length in tokens (``--tokenizer``) the output length.

Requests start all at once (``--request-rate inf``, profile_throughput's t=0 submission) or
with Poisson arrivals at ``--request-rate`` per second, at most ``--max-concurrency`` open at a
time; responses are streamed. Reported: requests/s, output and total tokens/s, TTFT, TPOT
(time per output token after the first), inter-chunk latency and end-to-end latency (mean,
p50/p90/p99), errors, and requests that came back short. With ``--server-pid`` (the
``conveyor serve api_server`` process, on this host) each stage's CPU time is read from /proc
every second: CPU ms per request and the cores each stage used (mean and the busiest second),
which is the headroom left to the ingress and tokenizer stages. The server's /metrics stage
counters (busy seconds of the stage loops) are recorded too.

    conveyor serve api_server --dummy-weights llama2-7b --max-batch-size 256 &
    python -m benchmarks.profile_restful_api --base-url http://127.0.0.1:23333 --server-pid $!
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

import httpx

from benchmarks.common import percentile, random_prompt, record, save

DATA = Path(__file__).resolve().parent / "data" / "sharegpt_shape_3000.jsonl"
STAGES = ("ingress", "tokenizer", "detokenizer", "engine")


@dataclass
class Request:
    """One request of the workload: token ids (or text, or chat messages) and its output length."""

    prompt: list[int] | str
    input_len: int
    output_len: int


@dataclass
class Result:
    """What one request measured (seconds from its own start)."""

    ok: bool = False
    ttft: float | None = None
    latency: float = 0.0
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str | None = None


def length_workload(path: Path, limit: int | None, vocab: int, seed: int) -> list[Request]:
    """profile_throughput's requests: the same lengths, the same random ids in the same order."""
    from benchmarks.profile_throughput import load_workload

    rng = random.Random(seed)
    return [Request(random_prompt(rng, i, vocab), i, o) for i, o in load_workload(path, limit)]


def sharegpt_workload(path: Path, limit: int | None, tokenizer_path: str, seed: int) -> list[Request]:
    """LMDeploy's sampling of a ShareGPT file: first human turn and reply, 4..1024 prompt tokens,
    at most 2048 together, ``limit`` of them drawn with ``seed``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = [r["conversations"] for r in json.loads(path.read_text()) if len(r.get("conversations", ())) >= 2]
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = []
    for conv in rows:
        prompt, reply = conv[0]["value"], conv[1]["value"]
        n_in, n_out = len(tok(prompt).input_ids), len(tok(reply).input_ids)
        if 4 <= n_in <= 1024 and n_out >= 4 and n_in + n_out <= 2048:
            out.append(Request(prompt, n_in, n_out))
        if limit and len(out) == limit:
            break
    return out


class StageCPU:
    """CPU seconds of each stage process under ``server_pid``, read from /proc every ``period`` s."""

    def __init__(self, server_pid: int, period: float = 1.0):
        self.server_pid, self.period = server_pid, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def start(self) -> "StageCPU":
        self.samples.append((time.perf_counter(), self.read()))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), self.read()))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.perf_counter(), self.read()))

    def read(self) -> dict[str, float]:
        """{stage name as its process is titled (tokenizer-0, ...): CPU seconds (user + system)}."""
        out = {}
        for pid in _descendants(self.server_pid):
            name = _stage_name(pid)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            if name:
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / self._tick
        return out

    def report(self, requests: int) -> dict[str, dict[str, float]]:
        """Per stage kind: CPU s, CPU ms per request, cores used (mean over the run; the busiest
        sample period; per process of the kind, the busiest one)."""
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        out = {}
        for kind in STAGES:
            names = [n for n in last if n.split("-")[0] == kind]
            if not names:
                continue
            cpu = sum(last[n] - first.get(n, 0.0) for n in names)
            peak = 0.0
            for (ta, a), (tb, b) in zip(self.samples, self.samples[1:]):
                if tb - ta > 0:
                    peak = max([peak, *((b.get(n, 0.0) - a.get(n, 0.0)) / (tb - ta) for n in names if n in a)])
            out[kind] = {"processes": len(names), "cpu_s": round(cpu, 3),
                         "cpu_ms_per_request": round(1e3 * cpu / max(requests, 1), 3),
                         "cores_mean": round(cpu / (t1 - t0), 3), "cores_peak_one_process": round(peak, 3)}
        return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(c) for c in task.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _stage_name(pid: int) -> str | None:
    """``tokenizer-0`` for a process titled ``conveyor: tokenizer-0`` (setproctitle), or its kind
    from the 15-character thread name (``conveyor: token``) when setproctitle is absent."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        if not title.startswith("conveyor: "):
            title = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if not title.startswith("conveyor: "):
        return None
    name = title.removeprefix("conveyor: ")
    kind = next((k for k in STAGES if k.startswith(name.split("-")[0]) or name.startswith(k)), None)
    return None if kind is None else (name if name.startswith(kind) else f"{kind}-{pid}")


def scrape_stage_stats(http: httpx.Client) -> dict[str, float]:
    """The stage counters (conveyor_stage_stat{stat=...}) of the server's /metrics."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('conveyor_stage_stat{stat="'):
            name, value = line.rsplit(" ", 1)
            out[name.split('"')[1]] = float(value)
    return out


async def one_request(http: httpx.AsyncClient, req: Request, args: argparse.Namespace, chat: bool) -> Result:
    body: dict[str, Any] = {"model": args.model, "max_tokens": req.output_len, "temperature": 0.0,
                            "ignore_eos": not args.disable_ignore_eos, "stream": not args.disable_stream}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    res, start = Result(), time.perf_counter()
    url = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if not body["stream"]:
            r = await http.post(url, json=body)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                res.output_tokens = r.json()["usage"]["completion_tokens"]
                res.ok = True
            res.latency = time.perf_counter() - start
            return res
        last = None
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or ()
                if any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.chunk_gaps.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_all(requests: list[Request], args: argparse.Namespace, chat: bool, limit: int, rate: float,
                  seed: int) -> tuple[list[Result], float]:
    """Send ``requests`` (Poisson arrivals at ``rate`` or all at once, at most ``limit`` open); the
    results and the seconds from the first send to the last reply."""
    gate = asyncio.Semaphore(limit)
    conns = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    rng = random.Random(seed)

    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(None, connect=30), limits=conns,
                                 headers=headers) as http:
        async def gated(req: Request) -> Result:
            async with gate:
                return await one_request(http, req, args, chat)

        tasks, start = [], time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(gated(req)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def client_worker(worker: int, workers: int, requests: list[Request], args: argparse.Namespace, chat: bool,
                  start_at: float) -> tuple[list[Result], float, float]:
    """One client process' share: every ``workers``-th request from ``worker`` on, its part of the
    concurrency and of the rate (N Poisson streams of rate r / N are one of rate r), started at
    ``start_at`` (perf_counter, the host's monotonic clock: the same in every process). Returns
    its results, the perf_counter time of its last reply and the CPU seconds it used."""
    import uvloop

    limit = args.max_concurrency or len(requests)
    mine = requests[worker::workers]
    cpu0 = time.process_time()
    time.sleep(max(0.0, start_at - time.perf_counter()))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results, _ = runner.run(run_all(mine, args, chat, limit // workers + (worker < limit % workers),
                                        args.request_rate / workers, args.seed * 1000 + worker))
    return results, time.perf_counter(), time.process_time() - cpu0


def run_clients(requests: list[Request], args: argparse.Namespace, chat: bool,
                cpu: "StageCPU | None") -> tuple[list[Result], float, dict]:
    """Every request through ``args.workers`` client processes (one client process could not
    read 7,000 streamed chunks a second and set up thousands of connections at once without
    becoming the bottleneck it measures); the results in request order, the wall seconds from the
    common start to the last reply, and the client's CPU use. ``cpu`` (the stages' CPU sampler)
    starts once the workers have forked: a fork must not copy its thread."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    workers = min(args.workers, len(requests), args.max_concurrency or len(requests))  # each has work
    start_at = time.perf_counter() + 1.0 + 0.1 * workers  # after every worker has forked
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        parts = [pool.submit(client_worker, w, workers, requests, args, chat, start_at) for w in range(workers)]
        if cpu:  # a fork start method forks every worker at the first submit
            cpu.start()
        parts = [f.result() for f in parts]
    if cpu:
        cpu.stop()
    results: list[Result] = [Result()] * len(requests)
    for w, (part, _, _) in enumerate(parts):
        results[w::workers] = part
    wall = max(end for _, end, _ in parts) - start_at
    usage = {"processes": workers, "cores_mean": round(sum(c for *_, c in parts) / wall, 3),
             "cores_busiest_process": round(max(c for *_, c in parts) / wall, 3), "start_monotonic": start_at}
    return results, wall, usage


def summarize(requests: list[Request], results: list[Result], wall: float) -> dict[str, Any]:
    """The report: throughput, latency percentiles (ms), errors."""
    ok = [(q, r) for q, r in zip(requests, results) if r.ok]
    out_tokens = sum(r.output_tokens for _, r in ok)
    in_tokens = sum(q.input_len for q, _ in ok)

    def stats(name: str, values: list[float]) -> dict[str, float | None]:
        ms = [v * 1e3 for v in values]
        return {f"{name}_ms": mean(ms) if ms else None, **{f"{name}_p{q}_ms": percentile(ms, q) for q in (50, 90, 99)}}

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for _, r in ok if r.ttft is not None and r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "num_requests": len(requests), "completed": len(ok), "errors": len(errors), "error_examples": errors[:5],
        "short": sum(1 for q, r in ok if r.output_tokens < q.output_len),  # fewer tokens than asked for
        "wall_s": wall, "in_tokens": in_tokens, "out_tokens": out_tokens,
        "req_s": len(ok) / wall, "out_tok_s": out_tokens / wall, "total_tok_s": (in_tokens + out_tokens) / wall,
        **stats("ttft", [r.ttft for _, r in ok if r.ttft is not None]), **stats("tpot", tpot),
        **stats("itl", [g for _, r in ok for g in r.chunk_gaps]), **stats("e2e", [r.latency for _, r in ok]),
    }


def main() -> None:
    from conveyor.engine.dummy_model import SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=23333)
    ap.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dataset-path", "--dataset", type=Path, default=DATA,
                    help="a jsonl of {input_len, output_len} (token-id prompts) or a ShareGPT .json (text)")
    ap.add_argument("--num-prompts", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="the prompts' ids lie in [100, vocab) (default: the served shape's, for a shape name)")
    ap.add_argument("--tokenizer", default=None, help="counts a ShareGPT file's tokens (default: the default model)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second, Poisson arrivals (default inf: all at t=0, as profile_throughput)")
    ap.add_argument("--max-concurrency", "--concurrency", type=int, default=None,
                    help="requests open at once (default: all of them)")
    ap.add_argument("--workers", type=int, default=4,
                    help="client processes sharing the requests, so that the client is not the bottleneck (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' ids (profile_throughput uses 0) and arrivals")
    ap.add_argument("--disable-stream", action="store_true", help="no streaming (no TTFT / TPOT)")
    ap.add_argument("--disable-ignore-eos", action="store_true", help="let requests end at the end-of-sequence token")
    ap.add_argument("--server-pid", type=int, default=None,
                    help="the api_server's pid (this host): sample each stage's CPU time from /proc")
    rec = ap.add_argument_group("record", "the server's settings, which a client cannot see, written into the record")
    rec.add_argument("--batch", type=int, default=None, help="its --max-batch-size")
    rec.add_argument("--tp", type=int, default=1)
    rec.add_argument("--quant-policy", type=int, default=0)
    rec.add_argument("--precision", default=None, help="its dtype (float16 on a GPU, by the shape)")
    ap.add_argument("--name", default=None, help="record file name (default: profile_restful_api_<model>)")
    ap.add_argument("--out", type=Path, default=None, help="write the record to this file instead of results/<gpu>/")
    args = ap.parse_args()
    if args.workers < 1:
        ap.error(f"--workers {args.workers}: give at least 1 client process")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")

    http = httpx.Client(base_url=args.base_url, timeout=30,
                        headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else None)
    args.model = args.model or http.get("/v1/models").json()["data"][0]["id"]
    chat = args.dataset_path.suffix == ".json"
    if chat:
        from conveyor.default_model import fetch

        requests = sharegpt_workload(args.dataset_path, args.num_prompts, args.tokenizer or str(fetch()), args.seed)
    else:
        vocab = args.vocab_size or SHAPES.get(args.model, {}).get("vocab_size")
        if vocab is None:
            ap.error(f"--vocab-size: the model {args.model!r} is not a known shape ({sorted(SHAPES)}); "
                     "give its vocabulary size")
        requests = length_workload(args.dataset_path, args.num_prompts, vocab, args.seed)
    print(f"{len(requests)} requests to {args.base_url} ({args.model}), "
          f"rate {args.request_rate}, concurrency {args.max_concurrency or 'all'}", flush=True)

    stats_before = scrape_stage_stats(http)
    cpu = StageCPU(args.server_pid) if args.server_pid else None
    results, wall, client_cpu = run_clients(requests, args, chat, cpu)
    time.sleep(1.2)  # the stage counters travel on the ingress's 0.5 s ring ping: let one pass
    stats_after = scrape_stage_stats(http)
    result = summarize(requests, results, wall)
    result["stage_cpu"] = cpu.report(result["completed"]) if cpu else None
    result["client_cpu"] = client_cpu
    # Busy seconds of the stage loops from /metrics; with several tokenizer workers the ping
    # passes one of them, so tokenizer_busy_s is one worker's (the /proc numbers cover all).
    result["stage_busy_s"] = {k: round(stats_after[k] - stats_before.get(k, 0.0), 4)
                              for k in stats_after if k.endswith("_busy_s")}
    for k, v in result.items():
        print(f"{k:>18}: {v:.3f}" if isinstance(v, float) else f"{k:>18}: {v}")
    rec = record(engine="conveyor-served", model=args.model, precision=args.precision, benchmark="profile_restful_api",
                 batch=args.batch, tp=args.tp, quant_policy=args.quant_policy, dataset=args.dataset_path.name,
                 endpoint="chat" if chat else "completions",
                 request_rate=None if math.isinf(args.request_rate) else args.request_rate,
                 max_concurrency=args.max_concurrency, stream=not args.disable_stream, **result)
    if args.out:
        args.out.write_text(json.dumps([rec], indent=1) + "\n")
        path = args.out
    else:
        path = save([rec], args.name or f"profile_restful_api_{args.model}")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
