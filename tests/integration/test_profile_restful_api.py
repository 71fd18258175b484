"""benchmarks/profile_restful_api.py against a real server of the tiny dummy shape on the CPU:
every request completes with the lengths asked for, and the record has the repository's fields,
the latency percentiles and each stage's CPU time. The server runs as the H200 served stage runs
it: the engine under benchmarks.timed_engine (its timeline counts the same tokens) and every
stage sampling its stacks (services/stack_sampler.py, read by benchmarks.stack_summary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from conveyor.testing.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [(12, 8), (30, 5), (7, 12), (50, 6), (3, 9)]


def test_served_benchmark_report(smollm2_dir, tmp_path):
    data = tmp_path / "work.jsonl"
    data.write_text("".join(json.dumps({"input_len": i, "output_len": o}) + "\n" for i, o in LENGTHS))
    timeline, stacks = tmp_path / "timeline.json", tmp_path / "stacks"
    srv = ServerProcess(smollm2_dir, "--dummy-weights", "tiny", "--max-batch-size", "4",
                        "--cache-max-entry-count", "64", "--cache-block-seq-len", "16", "--log-level", "WARNING",
                        engine_factory="benchmarks.timed_engine:build", log_dir=tmp_path,
                        env={"CONVEYOR_ENGINE_TIMELINE": str(timeline), "CONVEYOR_STACK_SAMPLES": str(stacks)})
    try:
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "tiny"  # the shape names the model
        out = tmp_path / "record.json"
        run = subprocess.run([sys.executable, "-m", "benchmarks.profile_restful_api", "--base-url", srv.url,
                              "--dataset-path", str(data), "--max-concurrency", "3", "--server-pid", str(srv.proc.pid),
                              "--batch", "4", "--workers", "2", "--out", str(out)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        srv.terminate()
    (rec,) = json.loads(out.read_text())
    for key in ("gpu", "commit", "command", "model", "benchmark", "batch", "input_len", "output_len", "out_tok_s",
                "ttft_ms", "model_format", "quant_policy", "tp", "req_s"):
        assert key in rec, key
    assert rec["benchmark"] == "profile_restful_api" and rec["model"] == "tiny" and rec["batch"] == 4
    assert rec["num_requests"] == rec["completed"] == len(LENGTHS) and rec["errors"] == 0 and rec["short"] == 0
    assert rec["out_tokens"] == sum(o for _, o in LENGTHS) and rec["in_tokens"] == sum(i for i, _ in LENGTHS)
    assert rec["out_tok_s"] > 0 and rec["req_s"] > 0
    for name in ("ttft", "tpot", "e2e"):
        p50, p90, p99 = (rec[f"{name}_p{q}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, (name, p50, p90, p99)
    assert rec["ttft_p99_ms"] <= rec["e2e_p99_ms"]
    # Every stage process was found under the server's pid and used some CPU.
    assert set(rec["stage_cpu"]) == {"ingress", "tokenizer", "detokenizer", "engine"}, rec["stage_cpu"]
    assert rec["stage_cpu"]["engine"]["cpu_s"] > 0
    assert "engine_busy_s" in rec["stage_busy_s"]
    # Two client processes shared the requests; their start is on the clock the engine timeline uses.
    assert rec["client_cpu"]["processes"] == 2 and rec["client_cpu"]["cores_mean"] > 0
    steps = json.loads(timeline.read_text())  # written again at the engine's close
    assert steps["tokens"] == rec["out_tokens"] and steps["steps"] >= max(o for _, o in LENGTHS)
    assert steps["first_step_monotonic"] >= rec["client_cpu"]["start_monotonic"] - 1.0
    assert steps["timeline"] and steps["timeline"][0]["running"] >= 1
    engine_stacks = list(stacks.glob("engine-*.folded"))
    assert len(engine_stacks) == 1 and "step (timed_engine.py" in engine_stacks[0].read_text()
    summary = subprocess.run([sys.executable, "-m", "benchmarks.stack_summary", str(stacks)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0 and "thread MainThread" in summary.stdout, summary.stderr
