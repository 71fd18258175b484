"""`conveyor serve gradio` in a real browser: Debian's chromium, headless, driven by playwright.

Both modes: the engine in the web chat's process (SmolLM2), and a running api_server (the
model-free fake engine, slowed so a reply streams). Each opens the page, types a message, watches
the reply arrive in pieces, cancels it mid-reply, sends a second turn, resets, and checks that
the page asked nothing of any other host. The screenshot in the docs comes from this test:
``CONVEYOR_WEBCHAT_SCREENSHOT=docs/images/webchat.png pytest tests/integration/test_webchat_browser.py``.

The page itself (markdown, markup that must stay text, the conversation kept over a reload, the
settings on a phone) is checked over a scripted backend served from this process: exact replies,
no model, a few seconds.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conveyor.testing.serve import FAKE_ENGINE
from conveyor.testing.server_process import ServerProcess, free_port
from conveyor.webchat import Piece, create_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("needs Debian's chromium (apt-get install chromium); .ci/run installs it",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip install playwright); "
                                                          ".ci/run installs it")

# Headless, and nothing that talks to the network on its own (the machines have none).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class WebChatProcess:
    """`conveyor serve gradio TARGET` in a subprocess, its log in a file."""

    def __init__(self, target: str, *extra: str, log_dir: Path):
        from conveyor.serving import wait_until_healthy

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"webchat-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli", "serve", "gradio", target, "--server-name", "127.0.0.1",
             "--server-port", str(self.port), *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_until_healthy(self.proc, self.url, 180)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.log_path.read_text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def in_process_chat(smollm2_dir, tmp_path_factory):
    chat = WebChatProcess(str(smollm2_dir), "--device", "cpu", "--cache-max-entry-count", "256",
                          log_dir=tmp_path_factory.mktemp("webchat"))
    yield chat
    chat.stop()
    # uvicorn shuts the app down on SIGTERM, then re-raises the signal.
    assert chat.proc.returncode in (0, -signal.SIGTERM), chat.log_path.read_text()
    assert "Application shutdown complete" in chat.log_path.read_text()


@pytest.fixture(scope="module")
def url_chat(smollm2_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("webchat-url")
    os.environ["CONVEYOR_FAKE_STEP_DELAY"] = "0.03"  # ~30 tokens/s: a reply streams long enough to cancel
    try:
        server = ServerProcess(smollm2_dir, "--session-len", "4096", log_dir=log_dir, engine_factory=FAKE_ENGINE)
    finally:
        os.environ.pop("CONVEYOR_FAKE_STEP_DELAY", None)
    try:
        chat = WebChatProcess(server.url, log_dir=log_dir)
        yield chat
        chat.stop()
    finally:
        server.terminate()


def reply_text(page) -> str:
    return page.locator(".msg.assistant .text").last.text_content()


def wait_idle(page, timeout_s: float) -> None:
    sync_api.expect(page.locator("body")).to_have_attribute("data-state", "idle", timeout=timeout_s * 1000)


def send(page, text: str, max_new_tokens: int, by_enter: bool = False) -> None:
    page.fill("#max_new_tokens", str(max_new_tokens))
    page.fill("#prompt", text)
    if by_enter:
        page.press("#prompt", "Enter")
    else:
        page.click("#send")


def chat_in_the_browser(browser, url: str, screenshot: Path | None = None) -> None:
    page = browser.new_page(viewport={"width": 1100, "height": 720})
    hosts: set[str] = set()
    page.on("request", lambda r: hosts.add(r.url.split("/")[2]))
    try:
        page.goto(url)
        wait_idle(page, 30)
        assert page.locator("#model").text_content()
        page.fill("#temperature", "0")  # greedy: the same reply each run

        # First turn: the reply arrives in pieces; cancel it halfway.
        send(page, "Write a long story about a dragon who learns to fly.", 300, by_enter=True)
        sync_api.expect(page.locator("body")).to_have_attribute("data-state", "generating")
        deadline = time.monotonic() + 60
        while len(reply_text(page)) < 40:
            assert time.monotonic() < deadline, "no reply streamed"
            time.sleep(0.01)
        # Part of the reply is on the page while the rest is still being generated.
        assert page.locator("body").get_attribute("data-state") == "generating"
        page.click("#cancel")
        wait_idle(page, 30)
        first = page.locator(".msg.assistant").last
        assert first.get_attribute("data-finish") == "abort", first.text_content()
        assert int(first.get_attribute("data-pieces")) >= 2
        assert "cancelled" in first.locator(".note").text_content()
        tokens = int(first.locator(".note").text_content().split()[0])
        assert 0 < tokens < 300

        # Second turn in the same conversation.
        send(page, "Give the dragon a name.", 40)
        wait_idle(page, 60)
        second = page.locator(".msg.assistant").last
        assert second.get_attribute("data-finish") in ("stop", "length") and reply_text(page).strip()
        assert page.locator(".msg.user").count() == 2 and page.locator(".msg.assistant").count() == 2
        assert page.locator(".msg.error").count() == 0
        if screenshot is not None:
            page.screenshot(path=str(screenshot))

        # Reset: a fresh conversation that works.
        page.click("#reset")
        sync_api.expect(page.locator(".msg")).to_have_count(0)
        send(page, "Hello!", 8)
        wait_idle(page, 60)
        assert page.locator(".msg.assistant").last.get_attribute("data-finish") in ("stop", "length")
        assert page.locator(".msg.user").count() == 1
    finally:
        page.close()
    assert hosts == {url.split("/")[2]}, f"the page asked other hosts: {hosts}"


def test_in_process_chat(browser, in_process_chat, tmp_path):
    shot = Path(os.environ.get("CONVEYOR_WEBCHAT_SCREENSHOT") or tmp_path / "webchat.png")
    chat_in_the_browser(browser, in_process_chat.url, screenshot=shot)
    assert shot.stat().st_size > 10_000


def test_api_server_chat(browser, url_chat):
    chat_in_the_browser(browser, url_chat.url)


# ---- the page over a scripted backend in this process --------------------------------------------

LONG_LINE = "x = [" + ", ".join(str(i) for i in range(80)) + "]"
MARKDOWN = f"""# Plan

Some **bold**, *italic*, ~~gone~~ and `inline code`; see [the docs](https://example.com/docs) or
[this](javascript:window.__pwned=3) or https://example.org/a_b.

- one
- two
  - nested

2. second
3. third

```python
def f(x):
    return x  # indented

{LONG_LINE}
```
Done."""
INJECTION = ('<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> '
             '**<b>b</b>** <a href="javascript:window.__pwned=4">a</a> [c](data:text/html,x) `<i>code</i>`')
HOLD_BEFORE = "So far:\n```python\nprint('so far')\n"
HOLD_AFTER = "print('then')\n```\nDone."


class ScriptedBackend:
    """Canned replies streamed 8 characters a piece: MARKDOWN for "markdown", the settings for
    "settings", for "hold" HOLD_BEFORE then (once ``release`` is set) HOLD_AFTER, else an echo."""

    model_name = "scripted"

    def __init__(self):
        self.ids = itertools.count(1)
        self.turns: list[tuple[int, str, object]] = []
        self.release = threading.Event()
        self._stopped: set[int] = set()

    def open(self) -> int:
        return next(self.ids)

    def turn(self, session_id, prompt, gen):
        self.turns.append((session_id, prompt, gen))
        self._stopped.discard(session_id)
        text = {"markdown": MARKDOWN, "hold": HOLD_BEFORE,
                "settings": f"temperature={gen.temperature} top_k={gen.top_k}"}.get(prompt, f"You said: {prompt}")
        pieces = [text[i:i + 8] for i in range(0, len(text), 8)]
        if prompt == "hold":
            pieces += [None] + [HOLD_AFTER[i:i + 8] for i in range(0, len(HOLD_AFTER), 8)]

        def stream():
            n = 0
            for piece in pieces:
                if piece is None:
                    assert self.release.wait(30), "the test never released the reply"
                    continue
                if session_id in self._stopped:
                    break
                time.sleep(0.002)
                n += 1
                yield Piece(piece, n, None)
            yield Piece("", n, "abort" if session_id in self._stopped else "stop")
        return stream()

    def stop(self, session_id: int) -> None:
        self._stopped.add(session_id)

    def end(self, session_id: int) -> None:
        self.stop(session_id)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def scripted_chat():
    import uvicorn

    backend = ScriptedBackend()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="webchat-scripted", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the scripted web chat did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", backend
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def page(browser, scripted_chat):
    """A page of the scripted chat in a fresh browser context (its own localStorage); at the end,
    no script error happened and no other host was asked."""
    url, _ = scripted_chat
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    errors: list[str] = []
    hosts: set[str] = set()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: hosts.add(r.url.split("/")[2]))
    page.goto(url)
    wait_idle(page, 10)
    yield page
    context.close()
    assert errors == []
    assert hosts == {url.split("/")[2]}, f"the page asked other hosts: {hosts}"


def turn(page, prompt: str) -> None:
    page.fill("#prompt", prompt)
    page.click("#send")
    wait_idle(page, 10)


def test_a_reply_renders_as_markdown(page):
    turn(page, "markdown")
    reply = page.locator(".msg.assistant .text").last
    assert int(page.locator(".msg.assistant").last.get_attribute("data-pieces")) >= 2
    assert reply.locator("h1").text_content() == "Plan"
    assert reply.locator("strong").text_content() == "bold" and reply.locator("em").text_content() == "italic"
    assert reply.locator("del").text_content() == "gone"
    assert reply.locator("p code").text_content() == "inline code"
    links = reply.locator("a")
    assert links.count() == 2  # the javascript: one stays text
    assert [links.nth(i).get_attribute("href") for i in range(2)] == ["https://example.com/docs",
                                                                       "https://example.org/a_b"]
    for i in range(2):
        assert links.nth(i).get_attribute("target") == "_blank"
        assert links.nth(i).get_attribute("rel") == "noopener noreferrer"
    assert "[this](javascript:window.__pwned=3)" in reply.text_content()
    assert reply.locator("> ul > li").count() == 2 and reply.locator("> ul > li > ul > li").text_content() == "nested"
    assert reply.locator("ol").get_attribute("start") == "2" and reply.locator("ol > li").count() == 2

    code = reply.locator("pre > code")
    assert code.text_content() == f"def f(x):\n    return x  # indented\n\n{LONG_LINE}"
    assert reply.locator("pre").get_attribute("data-lang") == "python"
    pre = reply.locator("pre").evaluate(
        "(pre) => ({ws: getComputedStyle(pre).whiteSpace, ox: getComputedStyle(pre).overflowX, "
        "font: getComputedStyle(pre.firstChild).fontFamily, scrolls: pre.scrollWidth > pre.clientWidth, "
        "inside: pre.getBoundingClientRect().right <= $('transcript').getBoundingClientRect().right})")
    assert pre == {"ws": "pre", "ox": "auto", "font": pre["font"], "scrolls": True, "inside": True}
    assert "monospace" in pre["font"]
    assert reply.locator("p").last.text_content() == "Done."


def test_markup_in_the_model_and_the_user_text_stays_text(page):
    turn(page, INJECTION)
    page.wait_for_timeout(200)  # time for an injected image to fail and run its handler
    assert page.evaluate("window.__pwned") is None
    transcript = page.locator("#transcript")
    assert transcript.locator("script, img, b, i, a").count() == 0
    assert page.locator(".msg.user .text").text_content() == INJECTION
    reply = page.locator(".msg.assistant .text")
    assert reply.text_content().startswith('You said: <script>window.__pwned = 1</script><img src=x onerror=')
    assert reply.locator("strong").text_content() == "<b>b</b>"
    assert reply.locator("code").text_content() == "<i>code</i>"


def test_an_unclosed_code_fence_renders_as_code_while_the_reply_streams(page, scripted_chat):
    _, backend = scripted_chat
    backend.release.clear()
    page.fill("#prompt", "hold")
    page.click("#send")
    try:
        code = page.locator(".msg.assistant .text pre > code")
        sync_api.expect(code).to_have_text("print('so far')\n", timeout=10_000)
        assert page.locator("body").get_attribute("data-state") == "generating"
        assert "```" not in page.locator(".msg.assistant .text").text_content()
    finally:
        backend.release.set()
    wait_idle(page, 10)
    assert code.text_content() == "print('so far')\nprint('then')"
    assert page.locator(".msg.assistant .text > p").all_text_contents() == ["So far:", "Done."]


def test_the_conversation_survives_a_reload_until_new_chat(page, scripted_chat):
    _, backend = scripted_chat
    page.fill("#temperature", "0.3")
    turn(page, "markdown")
    session = backend.turns[-1][0]
    page.reload()
    wait_idle(page, 10)
    assert page.locator(".msg.user .text").all_text_contents() == ["markdown"]
    assert page.locator(".msg.assistant .text pre > code").count() == 1  # rendered again, not stored as HTML
    assert "tokens" in page.locator(".msg.assistant .note").text_content()
    assert page.input_value("#temperature") == "0.3"
    # The server's session came back with the page: the model remembers the conversation.
    turn(page, "settings")
    assert backend.turns[-1][0] == session and page.locator(".msg.notice").count() == 0
    assert page.locator(".msg.assistant .text").last.text_content().startswith("temperature=0.3 ")

    page.click("#reset")
    sync_api.expect(page.locator(".msg")).to_have_count(0)
    wait_idle(page, 10)
    page.reload()
    wait_idle(page, 10)
    assert page.locator(".msg").count() == 0 and page.locator("#empty").is_visible()
    assert page.input_value("#temperature") == "0.3"  # New chat forgets the conversation, not the settings


@pytest.mark.parametrize("stored", [
    "{not json",
    "42",
    json.dumps({"v": 0, "messages": "old"}),
    json.dumps({"v": 1, "session": 7, "settings": {"temperature": "hot", "top_k": {"x": 1}, "top_p": "0.5"},
                "messages": [None, {"role": "assistant", "text": 42}, {"role": "<img src=x>", "text": "x"},
                             {"role": "user", "text": "kept"}, {"role": "assistant", "text": "**too**"}]}),
])
def test_a_spoiled_or_old_record_does_not_break_the_page(page, stored):
    page.evaluate("(value) => localStorage.setItem('conveyor.webchat', value)", stored)
    page.reload()
    wait_idle(page, 10)
    if stored.startswith('{"v": 1'):
        assert page.locator(".msg.user .text").all_text_contents() == ["kept"]
        assert page.locator(".msg.assistant strong").text_content() == "too"
        assert page.input_value("#temperature") == "0.8" and page.input_value("#top_p") == "0.5"
        # Its session is unknown to the server: the page says the model starts afresh.
        assert page.locator(".msg.notice").count() == 1
    else:
        assert page.locator(".msg").count() == 0
    turn(page, "hello")
    assert page.locator(".msg.assistant .text").last.text_content() == "You said: hello"


def test_the_settings_are_reachable_on_a_phone(page):
    page.set_viewport_size({"width": 375, "height": 667})
    assert not page.locator("#temperature").is_visible()
    page.click("#settings-toggle")
    assert page.get_attribute("#settings-toggle", "aria-expanded") == "true"
    for field in ("#max_new_tokens", "#temperature", "#top_p", "#top_k", "#repetition_penalty"):
        box = page.locator(field).bounding_box()
        assert page.locator(field).is_visible() and box["x"] >= 0 and box["x"] + box["width"] <= 375, field
    page.fill("#temperature", "0.25")
    page.fill("#top_k", "5")
    for button in ("#send", "#reset", "#prompt"):
        box = page.locator(button).bounding_box()
        assert box["x"] + box["width"] <= 375 and box["y"] + box["height"] <= 667, button
    turn(page, "settings")
    assert page.locator(".msg.assistant .text").last.text_content() == "temperature=0.25 top_k=5"
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    page.click("#settings-toggle")
    assert not page.locator("#temperature").is_visible()
    # Wide again: the settings are a side panel, always shown.
    page.set_viewport_size({"width": 1100, "height": 720})
    assert page.locator("#temperature").is_visible() and not page.locator("#settings-toggle").is_visible()
