"""The proxy (``conveyor serve proxy``) in front of two real api_servers running the fake engine
(real processes and HTTP, no model compute): joining with --proxy-url and the admin key, client
and admin keys, streaming, the three strategies, a node killed mid-stream, taken out and put
back, a node that hangs timed out and kept out, and leaving on a clean exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from conveyor.testing.serve import FAKE_ENGINE
from conveyor.testing.server_process import ServerProcess, free_port
from conveyor.testing.waiting import wait_until

KEY = "sk-proxy-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "sk-proxy-admin-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FAST_STEP_S, SLOW_STEP_S = 0.01, 0.06  # the fake engine's time per step on the two nodes
MESSAGES = [{"role": "user", "content": "hello"}]


class ProxyProcess:
    """``conveyor serve proxy`` in a subprocess, its log in a file."""

    def __init__(self, strategy: str, log_dir: Path, *extra: str, admin_key_file: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"proxy-{strategy}-{self.port}.log"
        self.admin_key_file = admin_key_file
        self._log = open(self.log_path, "w")
        admin = ["--admin-keys-file", str(admin_key_file)] if admin_key_file else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli", "serve", "proxy", "--server-name", "127.0.0.1", "--server-port",
             str(self.port), "--strategy", strategy, "--api-keys", KEY, "--health-interval", "0.3", *admin, *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_until(self._answers, "the proxy to answer", timeout=60, log=self.log)

    def _answers(self) -> bool:
        assert self.proc.poll() is None, self.log()
        try:
            return httpx.get(f"{self.url}/nodes/status", headers=AUTH, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def status(self) -> dict:
        return httpx.get(f"{self.url}/nodes/status", headers=AUTH, timeout=10).json()

    def add(self, url: str, **body) -> httpx.Response:
        """Add a node, from this host: with the admin key if the proxy has one, else without a key."""
        headers = ADMIN if self.admin_key_file else {}
        return httpx.post(f"{self.url}/nodes/add", json={"url": url, **body}, headers=headers, timeout=30)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def served(node: ServerProcess) -> int:
    """Generation requests ``node``'s ingress has finished (its e2e latency histogram's count)."""
    text = httpx.get(f"{node.url}/metrics", headers=AUTH, timeout=10).text
    name = "conveyor_e2e_request_latency_seconds_count "
    return int(next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)), 0))


def chat(proxy_url: str, max_tokens: int = 4, **extra) -> httpx.Response:
    return httpx.post(f"{proxy_url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": MESSAGES, "max_tokens": max_tokens, **extra})


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("proxy")
    key_file = log_dir / "admin-keys"
    key_file.write_text(f"{ADMIN_KEY}\n")
    p = ProxyProcess("min_expected_latency", log_dir, admin_key_file=key_file)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def nodes(smollm2_dir, proxy, tmp_path_factory):
    """(fast, slow): two api_servers that join ``proxy`` themselves; started side by side."""
    log_dir = tmp_path_factory.mktemp("nodes")
    made: dict[str, ServerProcess] = {}

    def start(name: str, step_s: float) -> None:
        made[name] = ServerProcess(smollm2_dir, "--session-len", "4096", "--proxy-url", proxy.url,
                                   "--proxy-admin-key-file", str(proxy.admin_key_file), log_dir=log_dir, api_key=KEY,
                                   engine_factory=FAKE_ENGINE, env={"CONVEYOR_FAKE_STEP_DELAY": str(step_s)})

    threads = [threading.Thread(target=start, args=a) for a in (("fast", FAST_STEP_S), ("slow", SLOW_STEP_S))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert set(made) == {"fast", "slow"}, "a node did not start (see the error above)"
        yield made["fast"], made["slow"]
    finally:
        for node in made.values():
            node.terminate()


@pytest.fixture(scope="module")
def client(proxy, nodes):
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0)


def test_api_servers_join_with_proxy_url(proxy, nodes, client, smollm2_dir):
    fast, slow = nodes
    wait_until(lambda: {fast.url, slow.url} <= set(proxy.status()), "both nodes to join", log=proxy.log)
    status = proxy.status()
    for node in nodes:
        assert status[node.url]["models"] == [smollm2_dir.name]
        assert status[node.url]["healthy"] is True and status[node.url]["unfinished"] == 0
    assert [m.id for m in client.models.list().data] == [smollm2_dir.name]
    assert client.models.retrieve(smollm2_dir.name).id == smollm2_dir.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(f"{proxy.url}/health").json() == {"status": "ok", "nodes_up": 2}  # open without a key


def test_the_proxy_wants_an_api_key(proxy, nodes):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/nodes/status")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, f"{proxy.url}{path}", headers=headers, json={"url": "http://x"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{proxy.url}/nodes/status", headers=ADMIN).status_code == 200


def test_a_client_key_cannot_change_the_routing(proxy, nodes):
    """Issue 28's takeover: with a client key, remove the real nodes and add one's own server."""
    fast, slow = nodes
    for path, url in [("/nodes/remove", fast.url), ("/nodes/add", "http://127.0.0.1:9")]:
        for headers, status, code in [({}, 401, "invalid_admin_key"), ({"Authorization": "Bearer wrong"}, 401,
                                      "invalid_admin_key"), (AUTH, 403, "admin_key_required")]:
            r = httpx.post(f"{proxy.url}{path}", headers=headers, json={"url": url, "status": {"models": ["m"]}})
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, r.text)
    assert set(proxy.status()) == {fast.url, slow.url}


def test_streaming_is_relayed_as_it_arrives(client, nodes):
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0)
    text, arrivals, finishes = "", [], []
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0,
                                                stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                arrivals.append(time.monotonic())
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert text == whole.choices[0].message.content and finishes == ["length"]
    # 30 engine steps of >= 10 ms each: a relay that buffered would hand them over at once
    assert len(arrivals) >= 20 and arrivals[-1] - arrivals[0] > 0.15, arrivals


def test_a_node_error_comes_back_as_the_node_sent_it(proxy, nodes):
    r = chat(proxy.url, temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(f"{proxy.url}/v1/chat/completions", headers=AUTH, content=b"not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = chat(proxy.url, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{proxy.url}/v1/chat/interactive", headers=AUTH, json={"prompt": "hi"})
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]


def _hold_stream(proxy_url: str, opened: threading.Event, release: threading.Event, chunks: list[bytes]) -> None:
    """A long stream through the proxy, read until ``release`` is set, then dropped by the client."""
    body = {"messages": MESSAGES, "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{proxy_url}/v1/chat/completions", headers=AUTH, json=body, timeout=60) as r:
        for piece in r.iter_bytes():
            chunks.append(piece)
            opened.set()
            if release.is_set():
                return


@contextlib.contextmanager
def _one_node_busy(proxy):
    """A long stream held open through the proxy while the block runs; yields the busy node's URL."""
    opened, release, chunks = threading.Event(), threading.Event(), []
    holder = threading.Thread(target=_hold_stream, args=(proxy.url, opened, release, chunks))
    holder.start()
    try:
        assert opened.wait(30)
        yield next(u for u, s in proxy.status().items() if s["unfinished"] == 1)
    finally:
        release.set()
        holder.join(30)


def test_min_expected_latency_sends_to_the_less_loaded_node(proxy, nodes):
    with _one_node_busy(proxy) as busy_url:
        busy, idle = sorted(nodes, key=lambda n: n.url != busy_url)
        before = served(idle), served(busy)
        for _ in range(4):
            assert chat(proxy.url).status_code == 200
        assert (served(idle) - before[0], served(busy) - before[1]) == (4, 0)
    # the client went away: the proxy counts the request out and the node aborts it
    wait_until(lambda: all(s["unfinished"] == 0 for s in proxy.status().values()), "the proxy to count it out")
    wait_until(lambda: "conveyor_requests_in_flight 0.0" in httpx.get(f"{busy.url}/metrics", headers=AUTH).text,
               "the node to abort the abandoned stream")


def test_min_observed_latency_prefers_the_faster_node(nodes, tmp_path):
    fast, slow = nodes
    p = ProxyProcess("min_observed_latency", tmp_path)
    try:
        for node in nodes:  # POST /nodes/add without models: the proxy asks the node, with the caller's key
            r = p.add(node.url)
            assert r.status_code == 200 and r.json() == "Added successfully", r.text
        before = served(fast), served(slow)
        for _ in range(6):
            assert chat(p.url, max_tokens=20).status_code == 200
        # each node is measured once, then the faster one takes the rest
        assert (served(fast) - before[0], served(slow) - before[1]) == (5, 1)
        latency = {url: sum(s["latency"]) / len(s["latency"]) for url, s in p.status().items()}
        assert latency[fast.url] < latency[slow.url]
    finally:
        p.stop()


def test_random_spreads_and_nodes_can_be_removed(nodes, tmp_path):
    fast, slow = nodes
    p = ProxyProcess("random", tmp_path)
    try:
        for node in nodes:
            assert p.add(node.url).status_code == 200
        before = served(fast), served(slow)
        for _ in range(30):
            assert chat(p.url, max_tokens=1).status_code == 200
        counts = served(fast) - before[0], served(slow) - before[1]
        assert sum(counts) == 30 and min(counts) >= 5, counts  # P(min < 5) ~ 6e-5 for a fair coin
        # LMDeploy's two forms of /nodes/remove: a body, and ?node_url=
        r = httpx.post(f"{p.url}/nodes/remove", json={"url": slow.url})  # no admin key: from this host
        assert r.status_code == 200 and r.json() == "Deleted successfully"
        before = served(fast), served(slow)
        for _ in range(4):
            assert chat(p.url, max_tokens=1).status_code == 200
        assert (served(fast) - before[0], served(slow) - before[1]) == (4, 0)
        assert httpx.post(f"{p.url}/nodes/remove", params={"node_url": fast.url}).status_code == 200
        assert p.status() == {}
        r = chat(p.url)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "no_node_available" and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{p.url}/health").status_code == 503
        r = httpx.post(f"{p.url}/nodes/remove", json={"url": fast.url})
        assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found"
        r = p.add(f"http://127.0.0.1:{free_port()}")  # nothing there
        assert r.status_code == 400 and r.json()["error"]["code"] == "node_unreachable"
    finally:
        p.stop()


def test_a_node_killed_mid_stream_is_taken_out_and_put_back(proxy, nodes):
    body = {"messages": MESSAGES, "max_tokens": 3000, "stream": True}
    events: list[bytes] = []
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", headers=AUTH, json=body, timeout=60) as r:
        lines = r.iter_lines()
        events.append(next(lines).encode())
        victim_url = next(u for u, s in proxy.status().items() if s["unfinished"] == 1)
        victim, other = sorted(nodes, key=lambda n: n.url != victim_url)
        ingress_pid = victim.stage_pids("ingress")[-1]
        os.kill(ingress_pid, signal.SIGKILL)
        events += [line.encode() for line in lines if line]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "node_failed" and victim.url in error["message"]
    assert all(e.startswith(b"data: {") for e in events[:-1])  # whole events only, none cut
    assert proxy.status()[victim.url]["healthy"] is False
    before = served(other)
    assert chat(proxy.url).status_code == 200  # the next request goes to the live node
    assert served(other) == before + 1
    # the victim's launcher restarts its ingress; the proxy's health checks put it back
    wait_until(lambda: proxy.status()[victim.url]["healthy"], "the node to be put back", timeout=90,
               log=victim.log)
    wait_until(lambda: victim.stage_pids("ingress")[-1] != ingress_pid, "the launcher to log the new ingress")
    with _one_node_busy(proxy) as busy_url:
        idle = next(n for n in nodes if n.url != busy_url)
        before = served(idle)
        assert chat(proxy.url).status_code == 200
        assert served(idle) == before + 1  # both nodes take requests again


@contextlib.contextmanager
def _hung_node():
    """A node that passes /health and takes completions without ever answering; yields its URL."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "15")
            self.end_headers()
            self.wfile.write(b'{"status":"ok"}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            release.wait()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_node_that_hangs_is_timed_out_and_kept_out(nodes, smollm2_dir, tmp_path):
    """Issue 28: a node that takes requests and never answers passes its /health; the proxy times
    it out (--first-byte-timeout) and keeps it out, so the next clients go to a node that answers."""
    fast, slow = nodes
    p = ProxyProcess("min_expected_latency", tmp_path, "--first-byte-timeout", "2", "--chunk-timeout", "2")
    try:
        with _hung_node() as hung_url:
            assert p.add(hung_url, status={"models": [smollm2_dir.name]}).status_code == 200
            start = time.monotonic()
            r = chat(p.url)
            assert r.status_code == 504 and r.json()["error"]["code"] == "node_timeout", r.text
            assert time.monotonic() - start < 10
            assert p.add(slow.url).status_code == 200
            before = served(slow)
            for _ in range(3):  # health checks every 0.3 s pass meanwhile: it stays out
                assert chat(p.url).status_code == 200
                time.sleep(0.2)
            assert served(slow) == before + 3
            status = p.status()[hung_url]
            assert status["healthy"] is False and status["timeouts"] == 1, status
    finally:
        p.stop()


def test_an_api_server_leaves_the_proxy_on_a_clean_exit(proxy, nodes):
    fast, slow = nodes
    assert fast.url in proxy.status()
    assert fast.terminate() == 0, fast.log()
    assert fast.url not in proxy.status()  # it left before it stopped serving
    assert slow.url in proxy.status()
    assert chat(proxy.url).status_code == 200
