"""conveyor.api_client against a real uvicorn server running the ingress on the fake engine:
sessions of its own per client, waits for a busy session, ends it on exit, readable errors."""

from __future__ import annotations

import asyncio
import builtins
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from conveyor.api_client import APIClient, APIConnectionError, normalize_url, terminal_chat
from conveyor.services.ingress.app import build_app
from conveyor.testing.server_process import free_port
from test_ingress import FakeEngineClient


@pytest.fixture
def served() -> Iterator[tuple[FakeEngineClient, str]]:
    """The ingress on a fake engine, served by uvicorn on its own loop in a thread."""
    engine, port = FakeEngineClient(), free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    yield engine, f"127.0.0.1:{port}"  # no scheme: the client adds http://
    server.should_exit = True
    thread.join(5)


def _typing(monkeypatch, *lines: str) -> None:
    """input() returns these lines, then Ctrl-D."""
    it = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


def test_each_terminal_client_has_its_own_session_and_ends_it(served, monkeypatch, capsys) -> None:
    engine, url = served
    for _ in range(2):
        _typing(monkeypatch, "a b", "c d")
        assert terminal_chat(url) == 0
    sids = [r.session_id for r in engine.requests]
    assert sids[0] == sids[1] and sids[2] == sids[3] and sids[0] != sids[2]  # two turns each, two sessions
    assert 0 < sids[0] < 2**31 and engine.ended == [sids[0], sids[2]]
    assert all(r.params.max_new_tokens == 512 for r in engine.requests)
    assert "a b\nc d\n" in capsys.readouterr().out


def test_a_fast_second_turn_waits_for_the_first_to_end(served) -> None:
    engine, url = served
    engine.settle = 0.3  # the session stays busy a moment after its answer arrived
    client = APIClient(url)
    assert [t for t, _, _ in client.chat("a b", 42, stream=True)] == ["a", " b"]
    assert [t for t, _, _ in client.chat("c", 42)] == ["c"]  # was: HTTP 400 session 42 is still generating
    client.close()


def test_no_server_is_one_line_not_a_traceback(capsys) -> None:
    assert terminal_chat(f"localhost:{free_port()}") == 1
    err = capsys.readouterr().err
    assert "is the server running" in err and "Traceback" not in err
    with pytest.raises(APIConnectionError, match="cannot connect"):
        _ = APIClient(f"http://127.0.0.1:{free_port()}").available_models  # the property asks the server
    assert normalize_url("localhost:23333/") == "http://localhost:23333"
    assert normalize_url("https://h:1") == "https://h:1"


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys; from conveyor.api_client import APIClient; import conveyor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_ctrl_c_at_the_prompt_quits_cleanly(served, monkeypatch, capsys) -> None:
    engine, url = served
    answers = iter(["a b"])

    def fake_input(prompt: str = "") -> str:
        for line in answers:
            return line
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", fake_input)
    assert terminal_chat(url, session_id=9) == 0
    assert engine.ended == [9] and "Traceback" not in capsys.readouterr().err
