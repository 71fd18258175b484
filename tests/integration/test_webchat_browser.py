"""`conveyor serve gradio` in a real browser: Debian's chromium, headless, driven by playwright.

Both modes: the engine in the web chat's process (SmolLM2), and a running api_server (the
model-free fake engine, slowed so a reply streams). Each opens the page, types a message, watches
the reply arrive in pieces, cancels it mid-reply, sends a second turn, resets, and checks that
the page asked nothing of any other host. The screenshot in the docs comes from this test:
``CONVEYOR_WEBCHAT_SCREENSHOT=docs/images/webchat.png pytest tests/integration/test_webchat_browser.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server_process import ServerProcess, free_port

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
        server = ServerProcess(smollm2_dir, "--engine-factory", "benchmarks.fake_engine:build", "--session-len",
                               "4096", log_dir=log_dir)
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
