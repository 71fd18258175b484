"""The ingress process: the FastAPI app on uvicorn (uvloop), with a draining shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvicorn
import zmq

from ...protocol import Addresses, Stage
from ..engine_client import EngineClient
from .app import begin_drain, build_app, inflight_requests
from ..stage import announce_ready, setup_logging
from ..tokenizer.preprocess import load_tokenizer

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """On SIGTERM: answer new requests with 503, let in-flight ones finish, then exit."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float = 60.0):
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self._draining = False

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._begin_drain)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher turns Ctrl-C into SIGTERM

    def _begin_drain(self) -> None:
        if self._draining:
            self.should_exit = True  # a second SIGTERM: stop now
            return
        self._draining = True
        begin_drain(self.config.app)
        asyncio.get_running_loop().create_task(self._exit_when_idle())

    async def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while inflight_requests(self.config.app) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


async def _serve(addresses: Addresses, model_path: str, model_name: str, session_len: int, host: str, port: int,
                 api_keys: list[str] | None, launcher: str | None, log_level: str) -> None:
    client = EngineClient(addresses, model_name, session_len)
    await client.start()
    app = build_app(client, api_keys=api_keys, served_model_name=model_name, tokenizer=load_tokenizer(model_path))
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           access_log=False, lifespan="off", timeout_keep_alive=30))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # re-raises a bind failure
            return
        await asyncio.sleep(0.05)
    announce_ready(zmq.Context.instance(), launcher, Stage.INGRESS, url=f"http://{host}:{port}")
    await task
    await client.close()


def run_ingress_process(addresses: Addresses, model_path: str, model_name: str, session_len: int, host: str,
                        port: int, api_keys: list[str] | None, launcher: str | None, log_level: str = "INFO") -> None:
    """Entry point of the ingress process."""
    setup_logging(log_level)
    logger.info("ingress pid %d", os.getpid())
    main = _serve(addresses, model_path, model_name, session_len, host, port, api_keys, launcher, log_level)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        logger.warning("uvloop not available; using asyncio's default loop")
        asyncio.run(main)
        return
    uvloop.run(main)
