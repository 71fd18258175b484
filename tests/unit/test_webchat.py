"""The web chat's HTTP API over a scripted backend (no model): sessions per tab, streamed turns,
cancel (also one that reaches the engine too early), reset, end, a reloaded page taking its
session back, idle and left-tab expiry, error envelopes. The page itself is tested in a browser
(tests/integration/test_webchat_browser.py)."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time

import pytest
from fastapi.testclient import TestClient

from conveyor.api_client import APIConnectionError, APIError
from conveyor.testing.server_process import free_port
from conveyor.testing.waiting import wait_until
from conveyor.webchat import Piece, create_app


class ScriptedBackend:
    """Streams 'w0 w1 ...' (one word per ``delay`` seconds) up to max_new_tokens; a stop ends the
    stream with 'abort' unless ``ignore_stops`` says the engine has not taken the turn yet."""

    model_name = "scripted"

    def __init__(self, delay: float = 0.005):
        self.delay = delay
        self.ids = itertools.count(1)
        self.turns: list[tuple[int, str, object]] = []
        self.stop_calls: list[int] = []
        self.ended: list[int] = []
        self.ignore_stops = 0
        self._stopped: set[int] = set()
        self._lock = threading.Lock()

    def open(self) -> int:
        return next(self.ids)

    def turn(self, session_id, prompt, gen):
        self.turns.append((session_id, prompt, gen))
        self._stopped.discard(session_id)  # a stop ends the running turn only
        if prompt == "refused":
            raise APIError(400, {"error": {"message": "too long", "type": "invalid_request_error",
                                           "param": "prompt", "code": "context_length_exceeded"}})
        if prompt == "unreachable":
            raise APIConnectionError("cannot connect to http://x: is the server running there?")

        def stream():
            for i in range(gen.max_new_tokens):
                time.sleep(self.delay)
                if session_id in self._stopped:
                    yield Piece("", i, "abort")
                    return
                if prompt == "fails midway" and i == 2:
                    raise RuntimeError("the engine stopped")
                yield Piece(f"w{i} ", i + 1, "length" if i + 1 == gen.max_new_tokens else None)
        return stream()

    def stop(self, session_id: int) -> None:
        with self._lock:
            self.stop_calls.append(session_id)
            if self.ignore_stops:
                self.ignore_stops -= 1
                return
            self._stopped.add(session_id)

    def end(self, session_id: int) -> None:
        self.ended.append(session_id)
        self.stop(session_id)

    def close(self) -> None:
        pass


@pytest.fixture
def backend():
    return ScriptedBackend()


@pytest.fixture
def client(backend):
    with TestClient(create_app(backend)) as c:
        yield c


def new_tab(client) -> str:
    r = client.post("/api/sessions")
    assert r.status_code == 200 and r.json()["model"] == "scripted"
    return r.json()["session"]


def lines(r) -> list[dict]:
    return [json.loads(line) for line in r.iter_lines() if line.strip()]


def test_page_is_self_contained(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    # Offline: the page names no other host, and the policy forbids loading from one.
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", r.text)
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    # Replies are built as DOM nodes from text: nothing on the page parses a string as HTML, so
    # neither the model nor a stored conversation can inject markup.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser",
                 "createContextualFragment", "srcdoc", "eval(", "new Function"):
        assert sink not in r.text, sink


def test_a_turn_streams_in_pieces_with_its_settings(client, backend):
    tab = new_tab(client)
    body = {"prompt": "hello", "max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
            "repetition_penalty": 1.1}
    with client.stream("POST", f"/api/sessions/{tab}/turns", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        out = lines(r)
    assert [o["text"] for o in out] == ["w0 ", "w1 ", "w2 ", "w3 "]
    assert [o["finish_reason"] for o in out] == [None, None, None, "length"] and out[-1]["tokens"] == 4
    sid, prompt, gen = backend.turns[0]
    assert prompt == "hello" and (gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k) == (4, 0.5, 0.9, 7)
    assert gen.repetition_penalty == 1.1
    # The next turn goes to the same session: the history is the backend's.
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "more", "max_new_tokens": 2}) as r:
        assert lines(r)[-1]["finish_reason"] == "length"
    assert backend.turns[1][0] == sid
    # Each tab has a session of its own.
    other = new_tab(client)
    with client.stream("POST", f"/api/sessions/{other}/turns", json={"prompt": "hi", "max_new_tokens": 1}) as r:
        lines(r)
    assert backend.turns[2][0] != sid


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "top_p": 7}, "top_p"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "top_k": "many"}, "top_k"),
    ({"prompt": "x", "seed": 1}, "seed"),  # unknown fields are refused, not ignored
])
def test_bad_settings_are_refused_with_the_field(client, backend, body, param):
    tab = new_tab(client)
    r = client.post(f"/api/sessions/{tab}/turns", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert backend.turns == []


def test_unknown_session_is_404(client):
    for path in ("turns", "cancel", "reset"):
        r = client.post(f"/api/sessions/nope/{path}", json={"prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert "reload the page" in r.json()["error"]["message"]


def test_errors_before_and_during_a_reply(client):
    tab = new_tab(client)
    r = client.post(f"/api/sessions/{tab}/turns", json={"prompt": "refused"})  # the api_server's envelope, as is
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post(f"/api/sessions/{tab}/turns", json={"prompt": "unreachable"})
    assert r.status_code == 502 and "is the server running" in r.json()["error"]["message"]
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "fails midway"}) as r:
        out = lines(r)
    assert [o.get("text") for o in out[:2]] == ["w0 ", "w1 "]
    assert out[-1]["error"]["message"] == "the reply failed: the engine stopped"
    # The tab still works.
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "ok", "max_new_tokens": 1}) as r:
        assert lines(r)[-1]["finish_reason"] == "length"


def test_cancel_ends_the_reply_and_a_second_turn_follows(client, backend):
    tab = new_tab(client)
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "long", "max_new_tokens": 2000}) as r:
        it = r.iter_lines()
        assert json.loads(next(it))["text"] == "w0 "
        # While it streams, the tab takes no second turn.
        busy = client.post(f"/api/sessions/{tab}/turns", json={"prompt": "again"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
        assert client.post(f"/api/sessions/{tab}/cancel").json() == {"cancelled": True}
        rest = [json.loads(line) for line in it if line.strip()]
    assert rest[-1]["finish_reason"] == "abort" and rest[-1]["tokens"] < 2000
    assert client.post(f"/api/sessions/{tab}/cancel").json() == {"cancelled": False}  # nothing runs now
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "next", "max_new_tokens": 2}) as r:
        assert lines(r)[-1]["finish_reason"] == "length"
    assert backend.turns[0][0] == backend.turns[1][0]  # the same session: cancel does not forget history


def test_a_stop_that_arrives_too_early_is_sent_again(client, backend):
    """A cancel that reaches the engine before it has taken the turn stops nothing; the next piece
    to arrive sends it again."""
    tab = new_tab(client)
    backend.ignore_stops = 2
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "long", "max_new_tokens": 2000}) as r:
        it = r.iter_lines()
        next(it)
        client.post(f"/api/sessions/{tab}/cancel")
        rest = [json.loads(line) for line in it if line.strip()]
    assert rest[-1]["finish_reason"] == "abort"
    assert len(backend.stop_calls) == 3


def test_reset_gives_the_tab_a_fresh_session(client, backend):
    tab = new_tab(client)
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "a", "max_new_tokens": 1}) as r:
        lines(r)
    first = backend.turns[0][0]
    assert client.post(f"/api/sessions/{tab}/reset").json() == {"session": tab}
    assert backend.ended == [first]
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "b", "max_new_tokens": 1}) as r:
        lines(r)
    assert backend.turns[1][0] != first


def test_reset_during_a_reply_stops_it_and_frees_the_tab(client, backend):
    tab = new_tab(client)
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "long", "max_new_tokens": 2000}) as r:
        it = r.iter_lines()
        next(it)
        client.post(f"/api/sessions/{tab}/reset")
        # The new session takes a turn at once, while the old reply is still ending.
        with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "b", "max_new_tokens": 1}) as r2:
            assert lines(r2)[-1]["finish_reason"] == "length"
        rest = [json.loads(line) for line in it if line.strip()]
    assert rest[-1]["finish_reason"] == "abort"


def test_end_forgets_the_tab(client, backend):
    tab = new_tab(client)
    assert client.post(f"/api/sessions/{tab}/end").json() == {"ended": True}
    assert backend.ended == [1]
    assert client.post(f"/api/sessions/{tab}/turns", json={"prompt": "x"}).status_code == 404


def test_a_page_that_goes_away_mid_reply_stops_it(client, backend):
    tab = new_tab(client)
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "long", "max_new_tokens": 2000}) as r:
        next(r.iter_lines())
    # The response was closed unread: the app stops the turn instead of generating for nobody.
    wait_until(lambda: backend.stop_calls, timeout=5, every=0.01)
    wait_until(lambda: not client.app.state.webchat.tabs[tab].busy, timeout=5, every=0.01)


def test_a_reloaded_page_gets_its_session_back_under_a_new_token(client, backend):
    tab = new_tab(client)
    with client.stream("POST", f"/api/sessions/{tab}/turns", json={"prompt": "a", "max_new_tokens": 1}) as r:
        lines(r)
    assert client.post(f"/api/sessions/{tab}/leave").json() == {"left": True}
    r = client.post("/api/sessions", json={"resume": tab})
    assert r.json()["resumed"] is True and r.json()["model"] == "scripted"
    again = r.json()["session"]
    assert again != tab
    with client.stream("POST", f"/api/sessions/{again}/turns", json={"prompt": "b", "max_new_tokens": 1}) as r:
        lines(r)
    assert backend.turns[1][0] == backend.turns[0][0] and backend.ended == []  # the same history
    # The old token is spent: another tab holding it cannot reach the conversation any more.
    assert client.post(f"/api/sessions/{tab}/cancel").status_code == 404
    assert client.post(f"/api/sessions/{tab}/leave").status_code == 404


def test_a_page_can_take_back_a_session_it_did_not_say_it_left(client, backend):
    """The page's leave beacon can arrive after the reloaded page's request, or never (a crash)."""
    tab = new_tab(client)
    r = client.post("/api/sessions", json={"resume": tab}).json()
    assert r["resumed"] is True and r["session"] != tab and len(client.app.state.webchat.tabs) == 1
    client.post(f"/api/sessions/{tab}/leave")  # late: changes nothing
    assert client.app.state.webchat.tabs[r["session"]].left_at is None


@pytest.mark.parametrize("body", [{"resume": "no-such-token"}, {}, None])
def test_a_session_the_server_does_not_have_is_opened_afresh(client, backend, body):
    r = client.post("/api/sessions", json=body) if body is not None else client.post("/api/sessions")
    assert r.status_code == 200 and r.json()["resumed"] is False and backend.ended == []


def test_open_refuses_what_it_does_not_know(client):
    r = client.post("/api/sessions", json={"resume": "x", "tab": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tab"


def test_a_left_tab_not_taken_back_is_ended(backend):
    with TestClient(create_app(backend, leave_grace_s=0.05)) as client:
        left, stays, back = new_tab(client), new_tab(client), new_tab(client)
        client.post(f"/api/sessions/{left}/leave")
        client.post(f"/api/sessions/{back}/leave")
        assert client.post("/api/sessions", json={"resume": back}).json()["resumed"] is True
        wait_until(lambda: backend.ended, timeout=5, every=0.01)  # by the periodic sweep: no other tab needs to open
        time.sleep(0.15)
        assert backend.ended == [1]
        assert client.post("/api/sessions", json={"resume": left}).json()["resumed"] is False
        assert client.post(f"/api/sessions/{stays}/cancel").status_code == 200


def test_a_left_tab_is_ended_even_if_the_backend_refuses(backend):
    def refuse(session_id):
        backend.ended.append(session_id)
        raise APIConnectionError("the api_server is gone")

    backend.end = refuse
    with TestClient(create_app(backend, leave_grace_s=0.05)) as client:
        tab = new_tab(client)
        client.post(f"/api/sessions/{tab}/leave")
        wait_until(lambda: backend.ended == [1], timeout=5, every=0.01)
        assert tab not in client.app.state.webchat.tabs
        assert new_tab(client)  # the sweep that open runs first does not fail it


def test_silent_tabs_are_ended_when_a_new_one_opens(backend):
    with TestClient(create_app(backend, idle_timeout_s=0.05)) as client:
        old = new_tab(client)
        time.sleep(0.1)
        new_tab(client)
        assert backend.ended == [1]
        assert client.post(f"/api/sessions/{old}/cancel").status_code == 404


def test_shutdown_ends_every_session_and_closes_the_backend(backend):
    closed = []
    backend.close = lambda: closed.append(True)
    with TestClient(create_app(backend, close_backend=True)) as client:
        new_tab(client)
        new_tab(client)
    assert sorted(backend.ended) == [1, 2] and closed == [True]


# ---- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["http://127.0.0.1:1", "--tp", "2", "--chat-template", "chatml"], "--tp, --chat-template: the api_server"),
    (["http://127.0.0.1:1"], "cannot connect to http://127.0.0.1:1"),
    (["some/model", "--api-key", "k"], "--api-key is for an api_server URL"),
    (["http://127.0.0.1:1", "--model-name", "qwen-7b"], "--model-name: the api_server"),
    (["some/model", "--model-name", "no-such-chat-7b"], "'no-such-chat-7b' names no built-in chat template"),
])
def test_gradio_command_refuses_what_it_would_ignore(monkeypatch, capsys, argv, says):
    import conveyor.default_model
    from conveyor.cli import main

    monkeypatch.setattr(conveyor.default_model, "fetch", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["serve", "gradio", *argv, "--server-name", "127.0.0.1", "--server-port", str(free_port())]) == 2
    assert says in capsys.readouterr().err


def test_gradio_command_checks_its_port_first(capsys):
    import socket

    from conveyor.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "gradio", "http://127.0.0.1:1", "--server-name", "127.0.0.1", "--server-port",
                     str(port)]) == 1
    assert "--server-port" in capsys.readouterr().err


def test_the_page_settings_start_at_the_interactive_defaults(client):
    from conveyor.protocol.sampling import INTERACTIVE_DEFAULTS
    from conveyor.webchat.app import SETTING_FIELDS

    page = client.get("/").text
    assert "%%" not in page  # every placeholder filled
    for name in SETTING_FIELDS:
        value = re.search(rf'id="{name}"[^>]*value="([^"]*)"', page).group(1)
        assert float(value) == getattr(INTERACTIVE_DEFAULTS, name), name
