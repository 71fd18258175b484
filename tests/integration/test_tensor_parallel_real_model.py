"""Tensor parallel on SmolLM2-135M-Instruct (9 heads, 3 kv heads) at tp=3 on the CPU (gloo):
the same greedy tokens as tp=1, batched, streaming, with prefix caching and a session; and on
a real server, a rank killed mid-request and SIGTERM with every rank running. Every engine here
is pinned to the CPU, also where a GPU is visible: three ranks need three GPUs."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest

from conveyor import EngineConfig, GenerationConfig, pipeline
from conveyor.testing.server_process import ServerProcess, pid_alive

from chat_prompts import PROMPTS

GREEDY = GenerationConfig(max_new_tokens=16, top_k=1)
PROMPTS_USED = PROMPTS[:10]


def _answers(smollm2_dir, tp: int) -> dict:
    cfg = EngineConfig(tp=tp, device="cpu", cache_max_entry_count=256, block_size=16, enable_prefix_caching=True)
    out = {}
    with pipeline(str(smollm2_dir), cfg) as pipe:
        out["batched"] = [r.token_ids for r in pipe(PROMPTS_USED, GREEDY)]
        streamed: dict[int, list[int]] = {}
        for r in pipe.stream_infer(PROMPTS_USED[:3], GREEDY):
            streamed.setdefault(r.index, []).extend(r.token_ids)
        out["streamed"] = [streamed[i] for i in range(3)]
        again = pipe(PROMPTS_USED[:2], GREEDY)  # the prompts' blocks are cached now
        out["cached"] = [r.token_ids for r in again]
        out["hits"] = all(r.num_cached_tokens > 0 for r in again)
        sess = pipe.chat("What is the capital of France?", gen_config=GREEDY)
        sess = pipe.chat("And of Germany?", session=sess, gen_config=GREEDY)
        out["session"] = sess.response.token_ids
    return out


def test_tp3_gives_tp1s_greedy_tokens(smollm2_dir) -> None:
    ref, got = _answers(smollm2_dir, 1), _answers(smollm2_dir, 3)
    assert got["hits"] and ref["hits"]
    for key in ("batched", "streamed", "cached", "session"):
        assert got[key] == ref[key], key


def _wait(predicate, what: str, timeout: float, srv: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; the server's log ends:\n{srv.log()[-6000:]}")
        time.sleep(0.1)


def _stream(url: str, max_tokens: int) -> tuple[int, str]:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            return r.status_code, "".join(r.iter_text())


@pytest.fixture
def tp_server(smollm2_dir, tmp_path):
    srv = ServerProcess(smollm2_dir, "--tp", "3", "--device", "cpu", "--max-restarts", "0",
                        "--cache-max-entry-count", "128", log_dir=tmp_path, start_timeout=300)
    yield srv
    srv.kill()


def test_a_rank_killed_mid_request_ends_it_with_an_error_and_leaves_no_process(tp_server) -> None:
    srv = tp_server
    ranks = srv.rank_pids()
    assert len(ranks) == 2
    with cf.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(_stream, srv.url, 400)
        _wait(lambda: "data:" in srv.log() or _generating(srv.url), "the stream to start", 60, srv)
        os.kill(ranks[0], signal.SIGKILL)
        status, body = inflight.result(timeout=120)
    assert status == 200
    assert '"error"' in body and body.rstrip().endswith("data: [DONE]"), body[-500:]
    # --max-restarts 0: the engine stage is not restarted, so the launcher gives up and exits 1,
    # leaving no rank behind.
    assert srv.proc.wait(60) == 1
    _wait(lambda: not any(pid_alive(p) for p in ranks), "every rank to exit", 30, srv)


def _generating(url: str) -> bool:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("conveyor_engine_generated_tokens ")), "x 0")
    return float(line.rsplit(" ", 1)[1]) > 0


def test_new_requests_get_503_while_the_engine_is_down(smollm2_dir, tmp_path) -> None:
    srv = ServerProcess(smollm2_dir, "--tp", "3", "--device", "cpu", "--cache-max-entry-count", "128", log_dir=tmp_path,
                        start_timeout=300)
    try:
        os.kill(srv.rank_pids()[1], signal.SIGKILL)
        _wait(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 503, "/health 503", 30, srv)
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["message"]
        # The launcher restarts the engine stage, which starts its ranks again.
        _wait(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200, "/health 200", 240, srv)
        assert len(srv.rank_pids()) == 4
    finally:
        srv.terminate()


def test_sigterm_stops_every_rank(tp_server) -> None:
    srv = tp_server
    ranks = srv.rank_pids()
    assert httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code == 200
    assert srv.terminate() == 0
    _wait(lambda: not any(pid_alive(p) for p in ranks), "every rank to exit", 30, srv)
