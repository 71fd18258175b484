"""The engine stepping in a background thread of the user's process, for the offline pipeline.

Callers hand it commands through a queue and read results from a queue per request; the
thread blocks when there is nothing to do. Detokenization runs here, right after each step,
so a stop string ends its request before the next step generates another token.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.llm_engine import LLMEngine, StepOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import FinishReason
from conveyor.services.detokenize import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    """New output of one request since the last delta."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    error: BaseException | None = None


@dataclass
class _Request:
    out: queue.Queue
    detok: IncrementalDetokenizer
    want_logprobs: bool
    deltas: list = field(default_factory=list)


class EngineDiedError(RuntimeError):
    """The engine thread stopped on an internal error; the pipeline must be recreated."""


class EngineThread:
    """Owns an LLMEngine and steps it in a daemon thread."""

    def __init__(self, engine: LLMEngine, tokenizer: Any):
        self.engine = engine
        self.tokenizer = tokenizer
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._requests: dict[int, _Request] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise its error)."""
        if self._error is not None:
            raise EngineDiedError(f"the engine thread died: {self._error!r}") from self._error
        future: Future = Future()
        self._commands.put((lambda: fn(self.engine), future))
        return future.result()

    def submit(self, seq_id: int, token_ids: list[int], params: SamplingParams, stop_strings: list[str],
               skip_special_tokens: bool, include_stop_str: bool, out: queue.Queue,
               session_id: int | None = None) -> None:
        """Add a request; its deltas go to ``out``. Raises the engine's validation errors."""
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, skip_special_tokens, stop_strings, include_stop_str)

        def add(engine: LLMEngine) -> None:
            engine.add_request(token_ids, params, seq_id=seq_id, session_id=session_id)
            self._requests[seq_id] = _Request(out, detok, params.logprobs is not None)

        self.call(add)

    def abort(self, seq_id: int) -> None:
        """Stop a request; it finishes with reason 'abort'."""
        self.call(lambda engine: engine.abort(seq_id))

    def close(self) -> None:
        """Stop the thread (requests still running get an 'abort')."""
        if not self._thread.is_alive():
            return
        future: Future = Future()

        def stop() -> None:
            self._stopping = True

        self._commands.put((stop, future))
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work and not self._stopping:
                    self._dispatch(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then the thread ends
            logger.exception("engine thread died")
            self._error = exc
        for seq_id, req in list(self._requests.items()):
            err = EngineDiedError(f"the engine thread died: {self._error!r}") if self._error else None
            req.out.put(Delta("", [], "abort", error=err))
        self._requests.clear()
        self._fail_waiting_commands()

    def _fail_waiting_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineDiedError("the engine is closed"))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                fn, future = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller gets its own error
                future.set_exception(exc)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self._requests.get(out.seq_id)
            if req is None:
                continue
            res = req.detok.step(out.token_ids)
            if res.stopped and not out.finished:
                self.engine.stop(out.seq_id)  # reported finished by the next step
            logprobs = None
            if req.want_logprobs and out.logprobs:
                logprobs = []
                for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs or [[]]):
                    entry = dict(top)
                    entry[tok] = lp
                    logprobs.append(entry)
            text, reason = res.text, None
            if out.finished:
                text += req.detok.finish()
                reason = FinishReason(out.finish_reason).openai
                del self._requests[out.seq_id]
            req.out.put(Delta(text, list(out.token_ids), reason, logprobs, out.num_cached_tokens))
