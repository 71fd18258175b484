"""Faults on a real server process running the fake engine (no model compute, fast)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest

from conveyor.testing.serve import FAKE_ENGINE
from conveyor.testing.server_process import ServerProcess, pid_alive
from conveyor.testing.waiting import wait_until


def _start(smollm2_dir, tmp_path, *extra, delay: float = 0.0) -> ServerProcess:
    os.environ["CONVEYOR_FAKE_STEP_DELAY"] = str(delay)
    try:
        return ServerProcess(smollm2_dir, "--session-len", "4096", *extra, log_dir=tmp_path, engine_factory=FAKE_ENGINE)
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


def _metric(url: str, name: str) -> float:
    """One unlabelled value from /metrics (0 when the server does not answer)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def _metric_stat(url: str, stat: str) -> float:
    """One stage counter from /metrics (conveyor_stage_stat{stat=...}), 0 when absent."""
    return _metric(url, f'conveyor_stage_stat{{stat="{stat}"}}')


def _generating(url: str, n: int = 1) -> bool:
    """At least ``n`` requests in flight and the engine producing tokens for them."""
    return (_metric(url, "conveyor_requests_in_flight") >= n
            and _metric(url, "conveyor_engine_generated_tokens") > 0)


def test_killing_one_of_two_tokenizers_under_load_hangs_nothing(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, "--tokenizer-workers", "2", delay=0.005)
    try:
        victim = srv.stage_pids("tokenizer")[0]
        with cf.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(_chat, srv.url, 200, i % 2 == 0) for i in range(64)]
            wait_until(lambda: _generating(srv.url, 8), "requests in flight")
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


def test_the_last_tokenizer_killed_gives_503_at_once(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, "--tokenizer-workers", "1")
    try:
        assert _chat(srv.url, 5)[0] == 200
        worker = srv.stage_pids("tokenizer")[0]
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: not pid_alive(worker), "the worker to die")
        start = time.monotonic()
        status, body = _chat(srv.url, 5, timeout=30)  # before: hung until the client gave up
        # 503 at once while no worker is connected (the launcher restarts it within seconds, and
        # a request after that is served): either way, an answer, and soon.
        assert status in (503, 200) and time.monotonic() - start < 15, body
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code in (200, 503)  # the ingress still answers
    finally:
        srv.terminate()


def test_hostile_frames_on_every_socket_leave_every_stage_serving(smollm2_dir, tmp_path):
    """Random bytes, truncated frames and well-formed messages with nonsense values, sent to every
    socket a stage binds (engine, detokenizer, launcher, the ingress's reply socket), forged
    launcher notices among them."""
    import random

    import msgspec
    import zmq

    from conveyor.protocol import (Abort, Admitted, CancelSession, Codec, EngineIn, ErrorOut, IngressGone, IngressIn,
                                   LoadReport, Ready, SamplingParams, SessionEnd, Stage, StageStatus, TextBatch,
                                   TokenBatch, TokenizedReq)

    srv = _start(smollm2_dir, tmp_path)
    run = srv.run_dir()
    try:
        targets = {p.name: f"ipc://{p}" for p in run.iterdir() if p.name in ("engine", "detokenizer", "launcher")
                   or p.name.startswith("reply-")}
        assert {"engine", "detokenizer", "launcher"} <= set(targets) and any(n.startswith("reply-") for n in targets)
        reply_to = next(f"ipc://{p}" for p in run.iterdir() if p.name.startswith("reply-"))
        rng = random.Random(0)
        nonsense = {
            "engine": [TokenizedReq("x1", "ipc:///nonexistent/reply", [10**9], SamplingParams(max_new_tokens=-5)),
                       TokenizedReq("x2", "ipc:///nonexistent/reply", [], SamplingParams()),
                       Abort("nobody"), CancelSession(-1), SessionEnd(2**62), IngressGone(reply_to, "forged")],
            "detokenizer": [TokenBatch(["a", "b", "c"], [1], [], [0]),  # ragged columns
                            Admitted("x3", "ipc:///nonexistent/reply", 5, SamplingParams().detokenize_params(),
                                     prompt_tail=[10**12]),
                            ErrorOut("x4", 400, "forged", reply_to="ipc:///nonexistent/reply")],
            "reply": [TextBatch(["a", "b"], ["t"], [], [0], [], [], []),
                      LoadReport("x", 0.0), ErrorOut("nobody", 500, "forged"),
                      StageStatus("engine", False, 1, 0, "forged")],  # before: /health pinned at 503
            "launcher": [Ready(Stage.ENGINE, os.getpid(), {"session_len": 1}, "forged")],
        }
        ctx = zmq.Context()
        try:
            for name, address in targets.items():
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 2000)
                sock.connect(address)
                codec = Codec(EngineIn if name == "engine" else IngressIn)
                good = [msgspec.msgpack.encode(m) for m in nonsense["reply" if name.startswith("reply") else name]]
                frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(100)]
                frames += [f[: rng.randrange(len(f))] for f in good for _ in range(5)]  # truncated
                frames += good + [b"", b"\x93\x01\x02", codec.encode(Abort("z"))[:-1]]
                for frame in frames:
                    sock.send(frame)
                sock.close()
        finally:
            ctx.term()
        for stage in ("engine", "detokenizer", "tokenizer", "ingress"):
            for pid in srv.stage_pids(stage):
                assert pid_alive(pid), stage
        status, body = _chat(srv.url, 20)
        assert status == 200 and '"finish_reason"' in body
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200, "/health 200")
        # The drops are counted (a forged LoadReport above may stand until the next real ping).
        wait_until(lambda: _metric_stat(srv.url, "engine_bad_frames") > 0
                    and _metric_stat(srv.url, "detokenizer_bad_frames") > 0
                    and _metric_stat(srv.url, "launcher_bad_frames") > 0
                    and _metric_stat(srv.url, "launcher_refused_ready") == 1, "the bad frames counted", log=srv.log)
        assert "ignored a stage notice without the launcher's token" in srv.log()
    finally:
        srv.terminate()
    assert not run.exists()  # the launcher removes the sockets' directory


def test_a_drain_past_its_timeout_ends_the_streams_and_exits_on_time(smollm2_dir, tmp_path):
    # Before: the stream ended only once the engine had been stopped too, with 'the engine
    # stopped answering', and the server exited ~21 s past its drain timeout.
    srv = _start(smollm2_dir, tmp_path, "--drain-timeout", "2", delay=0.02)
    with cf.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_chat, srv.url, 2000, True, 90)  # ~40 s of generation
        wait_until(lambda: _generating(srv.url), "the stream to start", log=srv.log)
        stopped = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        status, body = stream.result(timeout=60)
        assert status == 200 and "shutting down" in body and body.rstrip().endswith("data: [DONE]")
        assert srv.proc.wait(60) == 0
    assert time.monotonic() - stopped < 2 + 8, srv.log()[-3000:]


def test_engine_death_fails_its_streams_at_once_and_the_engine_comes_back(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, delay=0.02)
    try:
        engine = srv.stage_pids("engine")[0]
        assert open(f"/proc/{engine}/comm").read().startswith("conveyor:")  # its role, as ps shows it
        with cf.ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(_chat, srv.url, 100_000 // 100, True, 90)
            wait_until(lambda: _generating(srv.url), "the stream to start")
            killed = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            status, body = streaming.result(timeout=90)
        # An error chunk, then [DONE], well before the 10 s ring timeout would have said it.
        assert status == 200 and '"error"' in body and body.rstrip().endswith("data: [DONE]")
        assert time.monotonic() - killed < 8
        # The launcher restarts it; the server serves again and says how often it restarted.
        wait_until(lambda: len(srv.stage_pids("engine")) == 2, "the engine to restart", timeout=60)
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200, "/health 200", 60)
        assert _chat(srv.url, 5)[0] == 200
        assert _metric(srv.url, 'conveyor_stage_restarts{stage="engine"}') == 1.0
        assert _metric(srv.url, 'conveyor_stage_up{stage="engine"}') == 1.0
    finally:
        srv.terminate()


def test_a_dead_detokenizer_shows_in_health_at_once_and_comes_back(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path)
    try:
        detok = srv.stage_pids("detokenizer")[0]
        os.kill(detok, signal.SIGKILL)
        # Before: /health said 200 for ~10 s. Now the launcher tells the ingress within a second.
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 503, "/health 503", 3)
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200, "/health 200", 60)
        assert _chat(srv.url, 5)[0] == 200
    finally:
        srv.terminate()


def test_a_stage_that_keeps_dying_makes_the_launcher_exit_1(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, "--max-restarts", "1")
    first = srv.stage_pids("tokenizer")[0]
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: len(srv.stage_pids("tokenizer")) == 2, "the tokenizer to restart", timeout=60, log=srv.log)
    os.kill(srv.stage_pids("tokenizer")[1], signal.SIGKILL)
    assert srv.proc.wait(60) == 1  # an outer supervisor (systemd, compose restart:) takes over
    srv.terminate()


def test_sigterm_drains_in_flight_requests(smollm2_dir, tmp_path):
    srv = _start(smollm2_dir, tmp_path, delay=0.01)
    run = srv.run_dir()
    with cf.ThreadPoolExecutor(2) as pool:
        inflight = pool.submit(_chat, srv.url, 150, True, 90)  # ~1.5 s of generation
        wait_until(lambda: _generating(srv.url), "the stream to start")
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 503, "the drain to begin")
        # New clients are still accepted and told to come back (before: connection refused).
        late = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "hi"}]})
        assert late.status_code == 503 and late.headers.get("Retry-After") == "5"
        assert late.json()["error"]["code"] == "draining"
        status, body = inflight.result(timeout=90)
    assert status == 200 and '"finish_reason":"length"' in body.replace(" ", "")
    assert body.rstrip().endswith("data: [DONE]")
    assert srv.proc.wait(60) == 0
    assert not run.exists()


def _running(url: str) -> float:
    return _metric(url, "conveyor_engine_requests_running")


def test_an_ingress_killed_with_streams_in_flight_frees_the_engine(smollm2_dir, tmp_path):
    # Before: nothing told the engine, and each stream ran to its max_tokens for nobody.
    srv = _start(smollm2_dir, tmp_path, delay=0.02)
    try:
        ingress = srv.stage_pids("ingress")[0]
        with cf.ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(_chat, srv.url, 2000, True, 90) for _ in range(2)]
            wait_until(lambda: _generating(srv.url, 2), "two streams to start", log=srv.log)
            os.kill(ingress, signal.SIGKILL)
            for s in streams:
                with pytest.raises(httpx.HTTPError):
                    s.result(timeout=60)
        wait_until(lambda: len(srv.stage_pids("ingress")) == 2, "the ingress to restart", timeout=60, log=srv.log)
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200, "/health 200", 60, log=srv.log)
        # 2000 tokens at 20 ms a step is 40 s: both are aborted long before (the launcher's IngressGone).
        wait_until(lambda: _running(srv.url) == 0, "the engine to abort the dead ingress's requests", 10, log=srv.log)
        assert _metric_stat(srv.url, "engine_orphans_aborted") == 2
        assert _chat(srv.url, 5)[0] == 200
    finally:
        srv.terminate()


def test_a_dead_detokenizer_leaves_no_request_running(smollm2_dir, tmp_path):
    # The ingress fails the streams that went through it; it now aborts them in the engine too.
    srv = _start(smollm2_dir, tmp_path, delay=0.02)
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(_chat, srv.url, 2000, True, 90) for _ in range(2)]
            wait_until(lambda: _generating(srv.url, 2), "two streams to start", log=srv.log)
            os.kill(srv.stage_pids("detokenizer")[0], signal.SIGKILL)
            for s in streams:
                status, body = s.result(timeout=60)
                assert status == 200 and '"error"' in body
        wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200, "/health 200", 60, log=srv.log)
        wait_until(lambda: _running(srv.url) == 0, "the engine to abort the failed requests", 10, log=srv.log)
    finally:
        srv.terminate()


def test_killing_the_launcher_ends_every_stage(smollm2_dir, tmp_path):
    # Before: kill -9 on the launcher left every stage serving on the port, re-parented to init.
    srv = _start(smollm2_dir, tmp_path)
    try:
        pids = {name: srv.stage_pids(name)[0] for name in ("engine", "detokenizer", "tokenizer", "ingress")}
        run = srv.run_dir()
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in pids.values()),
                    f"every stage to exit (alive: {[n for n, p in pids.items() if pid_alive(p)]})", 30)
        assert not run.exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health", timeout=2)
    finally:
        srv.kill()


def test_schemathesis_finds_no_server_error(smollm2_dir, tmp_path):
    pytest.importorskip("schemathesis")
    import subprocess
    import sys

    # A short session_len bounds each fuzzed request's work: the fake engine outruns the ingress,
    # and a case like n=128 over several prompts with a huge max_tokens would otherwise keep the
    # ingress busy past the request timeout (an overload, not a server error).
    srv = _start(smollm2_dir, tmp_path, "--session-len", "512")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{srv.url}/openapi.json", "--checks",
             "not_a_server_error", "--max-examples", "15", "--phases", "examples,fuzzing",
             "--request-timeout", "20", "--no-color"],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    finally:
        srv.terminate()
