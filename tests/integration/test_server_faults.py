"""Faults on a real server process running the fake engine (no model compute, fast)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest

from server_process import ServerProcess


def _start(smollm2_dir, tmp_path, *extra, delay: float = 0.0) -> ServerProcess:
    os.environ["CONVEYOR_FAKE_STEP_DELAY"] = str(delay)
    try:
        return ServerProcess(smollm2_dir, "--fake-engine", "--session-len", "4096", *extra, log_dir=tmp_path)
    finally:
        os.environ.pop("CONVEYOR_FAKE_STEP_DELAY", None)


def _chat(url: str, max_tokens: int, stream: bool = False, timeout: float = 60) -> tuple[int, str]:
    body = {"model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": stream}
    with httpx.Client(timeout=timeout) as http:
        model = http.get(f"{url}/v1/models").json()["data"][0]["id"]
        body["model"] = model
        if not stream:
            r = http.post(f"{url}/v1/chat/completions", json=body)
            return r.status_code, r.text
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            return r.status_code, "".join(r.iter_text())


def test_killing_one_of_two_tokenizers_under_load_hangs_nothing(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, "--tokenizer-workers", "2", delay=0.005)
    try:
        victim = srv.stage_pids("tokenizer")[0]
        with cf.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(_chat, srv.url, 200, i % 2 == 0) for i in range(64)]
            time.sleep(0.3)
            os.kill(victim, signal.SIGKILL)
            results = [f.result(timeout=90) for f in futures]  # none may hang
        for status, body in results:
            assert status in (200, 503), body
            if status == 200:
                assert "error" not in body or '"finish_reason"' in body
        assert sum(1 for s, _ in results if s == 200) > 0
        for _ in range(5):  # new requests are served by the surviving worker
            status, body = _chat(srv.url, 20)
            assert status == 200, body
    finally:
        srv.terminate()


def test_engine_death_gives_503_not_hangs(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, delay=0.02)
    try:
        engine = srv.stage_pids("engine")[0]
        with cf.ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(_chat, srv.url, 100_000 // 100, True, 90)
            time.sleep(1.0)
            os.kill(engine, signal.SIGKILL)
            status, body = streaming.result(timeout=90)
        assert status == 200 and '"error"' in body and body.rstrip().endswith("data: [DONE]")
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status, body = _chat(srv.url, 5)
        assert status == 503 and '"error"' in body
    finally:
        srv.terminate()


def test_sigterm_drains_in_flight_requests(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, delay=0.01)
    with cf.ThreadPoolExecutor(2) as pool:
        inflight = pool.submit(_chat, srv.url, 150, True, 90)  # ~1.5 s of generation
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:  # a new request during the drain: 503 (or refused once the ingress has exited)
            late = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10,
                              json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
            assert late.status_code == 503
        except httpx.ConnectError:
            pass
        status, body = inflight.result(timeout=90)
    assert status == 200 and '"finish_reason":"length"' in body.replace(" ", "")
    assert body.rstrip().endswith("data: [DONE]")
    assert srv.proc.wait(60) == 0


def test_schemathesis_finds_no_server_error(smollm2_dir, tmp_path):
    pytest.importorskip("schemathesis")
    import subprocess
    import sys

    srv = _start(smollm2_dir, tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{srv.url}/openapi.json", "--checks",
             "not_a_server_error", "--max-examples", "15", "--phases", "examples,fuzzing",
             "--request-timeout", "20", "--no-color"],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    finally:
        srv.terminate()
