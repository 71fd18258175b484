"""The compose topology without Docker: each stage its own process, talking ZeroMQ over tcp://.

compose.yaml runs `conveyor serve stage NAME` per service with CONVEYOR_<NAME>_HOST naming the
peers; here every host is 127.0.0.1 and the ports come from a free base port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from conveyor.testing.server_process import free_base_port, free_port, wait_stages_healthy


def _forged_request_gets_nothing(base: int, url: str) -> None:
    """A peer on the network without the key: its request, sent straight to the engine's socket
    (skipping the API key), never runs, and the deployment goes on serving."""
    import zmq

    from conveyor.protocol import Codec, EngineIn, SamplingParams, TokenizedReq

    def generated() -> float:
        line = next(li for li in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
                    if li.startswith("conveyor_engine_generated_tokens"))
        return float(line.split()[-1])

    time.sleep(1.5)  # a load report after the last request
    before = generated()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.connect(f"tcp://127.0.0.1:{base + 1}")
        forged = TokenizedReq("forged", f"tcp://127.0.0.1:{base + 10}", [1, 2, 3], SamplingParams(max_new_tokens=5))
        with contextlib.suppress(zmq.Again):  # the handshake never completes: nothing is sent
            Codec(EngineIn).send(sock, forged)
    finally:
        ctx.destroy(linger=0)
    time.sleep(1.5)
    assert generated() == before, "the engine ran a request from a peer without the key"
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_stages_as_separate_processes_over_tcp(smollm2_dir, tmp_path):
    base, http_port = free_base_port(), free_port()
    keys = tmp_path / "curve.key_secret"
    subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "keygen", str(keys)], check=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CONVEYOR_INGRESS_HOST": "127.0.0.1",
           "CONVEYOR_ENGINE_HOST": "127.0.0.1", "CONVEYOR_DETOKENIZER_HOST": "127.0.0.1",
           "CONVEYOR_CURVE_KEY_FILE": str(keys)}
    common = [str(smollm2_dir), "--base-port", str(base), "--session-len", "1024", "--log-level", "INFO"]
    stages = {
        "engine": ["--cache-max-entry-count", "64", "--cache-block-seq-len", "16"],
        "detokenizer": [],
        "tokenizer-0": [],
        "tokenizer-1": [],
        "ingress": ["--server-name", "127.0.0.1", "--server-port", str(http_port)],
    }
    procs = {}
    try:
        for name, extra in stages.items():
            log = open(tmp_path / f"{name}.log", "w")
            cmd = [sys.executable, "-m", "conveyor.cli", "serve", "stage", name.split("-")[0], *common, *extra]
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{http_port}"
        wait_stages_healthy(procs, url, 180, "the tcp deployment", lambda name: (tmp_path / f"{name}.log").read_text())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        full = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=20)
        assert "Paris" in full.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=20, stream=True) if c.choices)
        assert streamed == full.choices[0].message.content
        _forged_request_gets_nothing(base, url)
        for p in procs.values():  # SIGTERM stops each stage, CURVE handler threads and all
            p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(30) for name, p in procs.items()}
        assert all(code == 0 for code in codes.values()), codes
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
