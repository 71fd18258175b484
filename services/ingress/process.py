"""The ingress process: the FastAPI app on uvicorn (uvloop), with a draining shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

import uvicorn
import zmq

from ...protocol import Addresses, Stage
from ..engine_client import EngineClient
from .app import begin_drain, build_app, inflight_requests
from .limits import IngressLimits, with_connection_limit, with_header_timeout
from .proxy_registration import ProxyRegistration, advertised_url
from .qos import QosConfig
from ..stage import announce_ready, begin_stage_process
from ..tokenizer.chat_template import get_chat_template, template_config
from ..tokenizer.preprocess import load_tokenizer
from .tool_calling import ChatParsing, chat_parsing

logger = logging.getLogger(__name__)

RING_WAIT_S = 30.0  # how long the ingress waits for the stages to answer before it says READY
DEADLINE_FLUSH_S = 2.0  # after the drain timeout, how long ended requests may take to tell their clients


class DrainingServer(uvicorn.Server):
    """On SIGTERM: keep accepting connections and answer new requests with 503 and Retry-After,
    let in-flight ones finish (up to ``drain_timeout`` seconds), then exit with code 0. Requests
    still running at the deadline are ended by ``on_deadline`` (an error chunk, then [DONE], and
    an abort in the engine) so that the exit comes at the deadline, not after the stages behind
    it have been stopped too and the streams noticed.

    uvicorn routes SIGTERM and SIGINT to ``handle_exit`` (older versions through
    ``install_signal_handlers``, newer through ``capture_signals``); overriding it works with both.
    SIGINT is ignored: the launcher turns Ctrl-C into SIGTERM for every stage, in order.
    """

    def __init__(self, config: uvicorn.Config, drain_timeout: float = 60.0,
                 on_drain: Callable[[], Awaitable[None]] | None = None,
                 on_deadline: Callable[[], None] | None = None):
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.on_drain = on_drain  # e.g. leave the proxy: it stops sending requests that would get 503
        self.on_deadline = on_deadline  # fail the requests still in flight when the drain time is up
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            return
        if self._draining:
            self.should_exit = True  # a second SIGTERM: stop now
            return
        self._draining = True
        # A signal handler runs between two bytecodes of the loop's thread: hand the work to the loop.
        asyncio.get_running_loop().call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        begin_drain(self.config.app)
        if self.on_drain is not None:
            asyncio.get_running_loop().create_task(self.on_drain())
        asyncio.get_running_loop().create_task(self._exit_when_idle())

    async def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while inflight_requests(self.config.app) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = inflight_requests(self.config.app)
        if left and self.on_deadline is not None:
            logger.warning("drain timeout (%.0fs) passed with %d request(s) in flight: ending them", self.drain_timeout,
                           left)
            self.on_deadline()
            end = time.monotonic() + DEADLINE_FLUSH_S  # their error chunks reach the clients
            while inflight_requests(self.config.app) > 0 and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.should_exit = True


async def _serve(addresses: Addresses, model_path: str, model_name: str, session_len: int, host: str, port: int,
                 api_keys: list[str] | None, launcher: str | None, log_level: str, drain_timeout: float,
                 limits: IngressLimits, qos: QosConfig | None, proxy_url: str | None,
                 proxy_admin_key: str | None = None,
                 chat_options: tuple[str | None, str | None, str | None] = (None, None, None),
                 adapter_paths: dict[str, str] | None = None) -> None:
    tokenizer = load_tokenizer(model_path)
    chat = _chat_parsing(model_path, tokenizer, *chat_options)
    client = EngineClient(addresses, model_name, session_len, request_timeout=limits.request_timeout_s,
                          adapter_paths=adapter_paths)
    await client.start()
    app = build_app(client, api_keys=api_keys, served_model_name=model_name, tokenizer=tokenizer,
                    limits=limits, qos=qos, chat=chat)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # the class uvicorn would pick (httptools or h11)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                            lifespan="off", timeout_keep_alive=30, limit_concurrency=limits.max_connections,
                            timeout_graceful_shutdown=DEADLINE_FLUSH_S,  # past the drain: nothing is left to wait for
                            http=with_connection_limit(with_header_timeout(AutoHTTPProtocol, limits.header_timeout_s)))
    registration = ProxyRegistration(proxy_url, advertised_url(host, port), [model_name],
                                     proxy_admin_key) if proxy_url else None
    server = DrainingServer(config, drain_timeout=drain_timeout,
                            on_drain=registration.leave if registration else None,
                            on_deadline=lambda: client.fail_all(
                                f"the server is shutting down: requests still running {drain_timeout:g}s after "
                                "the stop (--drain-timeout) were ended; retry"))
    # Listen only once the first ping has gone round the ring: a client that polls /v1/models
    # (as LMDeploy's users and scripts do) would otherwise get 200 there and then 503 on its first
    # request. READY follows listening. A ring that stays silent is reported by /health instead.
    deadline = time.monotonic() + RING_WAIT_S
    while not client.healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not client.healthy:
        logger.warning("no answer from the stage ring after %.0fs: serving, with /health at 503", RING_WAIT_S)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # re-raises a bind failure
            return
        await asyncio.sleep(0.05)
    announce_ready(zmq.Context.instance(), launcher, Stage.INGRESS, addresses, url=f"http://{host}:{port}",
                   reply_to=client.reply_to)  # where the launcher sends StageStatus
    if registration is not None:
        registration.start()
    await task
    if registration is not None:
        await registration.leave()
    await client.close()


def _chat_parsing(model_path: str, tokenizer: object, chat_template: str | None, tool_call_parser: str | None,
                  reasoning_parser: str | None) -> ChatParsing:
    """The chat route's parsers; without --tool-call-parser, the format of the chat template the
    tokenizer stage renders with (picked here the same way)."""
    template = None
    if not tool_call_parser:
        try:
            template = get_chat_template(model_path, template_config(chat_template), tokenizer)
        except Exception:  # the tokenizer stage reports a bad template; here only the tool format is missing
            logger.warning("could not pick the chat template's tool format: requests with tools need "
                           "--tool-call-parser", exc_info=True)
    chat = chat_parsing(tool_call_parser, reasoning_parser, template)
    logger.info("tool-call parser: %s; reasoning parser: %s",
                f"{chat.tool_parser} (from {chat.tool_parser_origin})" if chat.tool_parser else "none",
                chat.reasoning_parser or "none")
    return chat


def run_ingress_process(name: str, addresses: Addresses, model_path: str, model_name: str, session_len: int, host: str,
                        port: int, api_keys: list[str] | None, launcher: str | None, log_level: str = "INFO",
                        drain_timeout: float = 60.0, limits: IngressLimits | None = None,
                        qos: QosConfig | None = None, proxy_url: str | None = None,
                        proxy_admin_key: str | None = None, chat_template: str | None = None,
                        tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                        adapter_paths: dict[str, str] | None = None) -> None:
    """Entry point of the ingress process; ``qos``: the user groups (--qos-config-path);
    ``proxy_admin_key``: what it presents to join ``proxy_url`` (None: join from the proxy's host);
    ``chat_template`` (--chat-template, as the tokenizer stage has it), ``tool_call_parser`` and
    ``reasoning_parser``: the chat route's output parsers; ``adapter_paths``: the LoRA adapters the
    engine starts with (name -> checkpoint), whose paths /v1/models shows."""
    begin_stage_process(name, log_level, addresses, launcher)
    logger.info("ingress pid %d", os.getpid())
    main = _serve(addresses, model_path, model_name, session_len, host, port, api_keys, launcher, log_level,
                  drain_timeout, limits or IngressLimits(), qos, proxy_url, proxy_admin_key,
                  (chat_template, tool_call_parser, reasoning_parser), adapter_paths)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        logger.warning("uvloop not available; using asyncio's default loop")
        asyncio.run(main)
        return
    uvloop.run(main)
