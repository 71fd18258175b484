"""The engine process: builds the engine (an ``LLMEngine``, or what ``engine_factory`` names)
and serves it."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable

import zmq

from ...engine.config import EngineConfig
from ...engine.interface import Engine
from ...protocol import Addresses
from ..stage import begin_stage_process, stop_on_sigterm
from .service import EngineService

logger = logging.getLogger(__name__)


def _exit_stage(why: str) -> None:
    """A tensor-parallel rank failed: this process exits, so that the launcher fails the requests in
    flight (error chunk, then [DONE]), answers 503 meanwhile, and restarts the engine stage. (The
    engine thread may be stuck in a collective with the dead rank: only an exit frees it.)"""
    logger.error("engine stage exiting: tensor-parallel %s", why)
    logging.shutdown()
    os._exit(1)


def load_engine_factory(spec: str) -> Callable[[str, EngineConfig], Engine]:
    """``"module:callable"`` -> the callable (it takes the model path and the EngineConfig)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"engine factory {spec!r}: write it as 'module:callable'")
    return getattr(importlib.import_module(module), name)


def run_engine_process(name: str, addresses: Addresses, model_path: str, config: EngineConfig, launcher: str | None,
                       log_level: str = "INFO", engine_factory: str | None = None) -> None:
    """Entry point of the engine process."""
    begin_stage_process(name, log_level, addresses, launcher)
    stop = stop_on_sigterm()
    if engine_factory:
        engine = load_engine_factory(engine_factory)(model_path, config)
    else:
        from ...engine.llm_engine import LLMEngine

        engine = LLMEngine(model_path, config)
    workers = getattr(engine, "tp_workers", None)
    if workers is not None:
        workers.on_failure = _exit_stage
    info = {"session_len": engine.session_len, "num_blocks": engine.stats().num_blocks}
    try:
        EngineService(engine, zmq.Context(), addresses).serve(stop, launcher, info)
    finally:
        close = getattr(engine, "close", None)  # the Engine protocol does not require it
        if close is not None:
            close()
