"""Issue 28, finding 3: a node that takes a request and then hangs (never answers, or stalls
mid-answer) is timed out and quarantined, though its /health passes, and answers are relayed in
bounded memory. A real proxy (uvicorn in a thread) in front of stand-in nodes."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from proxy_harness import MODEL, ProxyServer, StandInNode

FAST = {"first_byte_timeout_s": 0.3, "chunk_timeout_s": 0.3, "health_interval_s": 0.05}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def _add(proxy: ProxyServer, node: StandInNode) -> None:
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": node.url, "status": {"models": [MODEL]}}, timeout=10)
    assert r.status_code == 200, r.text


def _status(proxy: ProxyServer, node: StandInNode) -> dict:
    return httpx.get(f"{proxy.url}/nodes/status", timeout=10).json()[node.url]


def test_a_node_that_never_answers_is_timed_out_and_stays_out_while_its_health_passes():
    with StandInNode("hang") as hung, StandInNode("ok") as good, ProxyServer(**FAST) as proxy:
        _add(proxy, hung)
        start = time.monotonic()
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert time.monotonic() - start < 3
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "node_timeout" and hung.url in error["message"]
        # its /health passes at every check (each 0.05 s), yet it stays out: quarantined
        assert httpx.get(f"{hung.url}/health").status_code == 200
        time.sleep(0.3)
        status = _status(proxy, hung)
        assert status["healthy"] is False and status["timeouts"] == 1 and "quarantined" in status["down_reason"]
        assert httpx.get(f"{proxy.url}/health").status_code == 503
        _add(proxy, good)  # the next client goes to a node that answers
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert not _status(proxy, hung)["healthy"]


def test_a_stream_that_stalls_ends_with_an_error_event_and_done():
    # The stall under test comes after the first event, so only the chunk timeout is short: a 0.3 s
    # first-byte limit once ran out on a loaded 2-core CI machine before the first event came (504).
    with StandInNode("stall_stream") as node, ProxyServer(**{**FAST, "first_byte_timeout_s": 5.0}) as proxy:
        _add(proxy, node)
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=10) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line]
        assert events[0].startswith("data: {") and events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "node_timeout" and node.url in error["message"]
        assert _status(proxy, node)["timeouts"] == 1 and not _status(proxy, node)["healthy"]


def test_an_answer_that_stalls_midway_is_a_clean_504():
    with StandInNode("stall_body", size=10_000) as node, ProxyServer(**FAST) as proxy:
        _add(proxy, node)
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "node_timeout", r.text
        assert not _status(proxy, node)["healthy"]


def test_a_large_answer_is_passed_on_before_it_has_all_arrived():
    """Past the cap the proxy holds nothing back: the node sends its second half only once the
    client has bytes of the first (a proxy that read answers whole would wait for both)."""
    cap = 64 * 1024
    with StandInNode("big", size=4 * cap) as node, \
            ProxyServer(whole_answer_cap=cap, health_interval_s=0.05, chunk_timeout_s=10) as proxy:
        _add(proxy, node)
        received = b""
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            for piece in r.iter_bytes():
                received += piece
                node.go.set()
        assert node.go_in_time is True
        assert received == node.expected_body()
        assert _status(proxy, node)["healthy"] and _status(proxy, node)["unfinished"] == 0


def test_a_large_answer_cut_midway_is_cut_for_the_client_too():
    """Its status line is gone: an answer that would look complete must not reach the client."""
    cap = 64 * 1024
    with StandInNode("big_then_break", size=4 * cap) as node, \
            ProxyServer(whole_answer_cap=cap, health_interval_s=60) as proxy:
        _add(proxy, node)
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
        status = _status(proxy, node)
        assert status["unfinished"] == 0 and not status["healthy"] and "broke off" in status["down_reason"]
