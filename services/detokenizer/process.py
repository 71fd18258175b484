"""The detokenizer's process loop: dispatches on the message type.

Admitted starts a request's state and is forwarded to its ingress; a TokenBatch becomes text
for each ingress (and StopReq to the engine for stop strings); an ErrorOut (a refusal) is
forwarded, as is an AdapterDone (a LoRA adapter loaded or unloaded); a LoadReport gets this
stage's counters and goes on to the ingress that pinged. A message that fails its checks
(``protocol/checks.py``) is dropped whole and counted.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from ...protocol import (
    AdapterDone,
    Addresses,
    Admitted,
    Codec,
    DetokenizerIn,
    EngineIn,
    ErrorOut,
    LoadReport,
    Stage,
    StopReq,
    TokenBatch,
)
from ...protocol.checks import MalformedMessageError, check_error_out
from ..stage import (SEND_TIMEOUT_MS, ReplySockets, announce_ready, begin_stage_process, open_socket,
                     stop_on_sigterm)
from ..tokenizer.loader import load_tokenizer
from .batches import Detokenizer

logger = logging.getLogger(__name__)


def serve_detokenizer(ctx: zmq.Context, addresses: Addresses, detok: Detokenizer, stop: threading.Event,
                      launcher: str | None = None) -> None:
    """The stage loop: blocks on its input, wakes every 0.5 s only to check ``stop``."""
    inbox = open_socket(ctx, zmq.PULL, bind=addresses.detokenizer_in.bind, curve=addresses.curve)
    engine = open_socket(ctx, zmq.PUSH, connect=addresses.engine_in.connect, send_timeout_ms=SEND_TIMEOUT_MS,
                         curve=addresses.curve)
    replies = ReplySockets(ctx, addresses)
    in_codec, engine_codec = Codec(DetokenizerIn), Codec(EngineIn)
    announce_ready(ctx, launcher, Stage.DETOKENIZER, addresses)
    busy, tokens, bad_messages = 0.0, 0, 0  # reported on LoadReports

    def handle(msg) -> int:
        """Apply one message by its type; returns the tokens it carried."""
        if isinstance(msg, TokenBatch):
            batches, stops = detok.process(msg)
            for rid in stops:
                stop_in_engine(rid)
            for addr, tb in batches.items():
                replies.send(addr, tb)
            return len(msg.rids)
        if isinstance(msg, Admitted):
            errors = detok.admit(msg)  # first: a malformed one raises and is not forwarded either
            replies.send(msg.reply_to, msg)
            fail(errors)
        elif isinstance(msg, ErrorOut):
            check_error_out(msg)
            replies.send(msg.reply_to, msg)
        elif isinstance(msg, AdapterDone):
            replies.send(msg.reply_to, msg)
        elif isinstance(msg, LoadReport):
            msg.stage_stats.update(detokenizer_busy_s=busy, detokenizer_tokens=tokens,
                                   detokenizer_bad_frames=in_codec.dropped, detokenizer_bad_messages=bad_messages,
                                   detokenizer_refused_replies=replies.refused)
            replies.send(msg.reply_to, msg)
        return 0

    def stop_in_engine(rid: str) -> None:
        try:
            engine_codec.send(engine, StopReq(rid))
        except zmq.Again:  # the engine is gone: the ring's silence fails the request anyway
            logger.warning("could not tell the engine to stop %s", rid)

    def fail(errors: list[ErrorOut]) -> None:
        for err in errors:  # requests failed here: the engine must stop them too
            replies.send(err.reply_to, err)
            stop_in_engine(err.rid)

    try:
        while not stop.is_set():
            if not inbox.poll(500):
                continue
            for msg in in_codec.recv_all(inbox):
                start = time.perf_counter()
                try:
                    tokens += handle(msg)
                except MalformedMessageError as exc:  # checked before any of it was applied
                    bad_messages += 1
                    if bad_messages & (bad_messages - 1) == 0:  # 1st, 2nd, 4th, ...: a flood logs little
                        logger.warning("dropped a malformed message (%d so far): %s", bad_messages, exc)
                except Exception:  # an inconsistent message must not stop the stage
                    bad_messages += 1
                    logger.exception("dropped a %s that could not be applied", type(msg).__name__)
                busy += time.perf_counter() - start
    finally:
        inbox.close(linger=0)
        engine.close(linger=0)
        replies.close()


def run_detokenizer_process(name: str, addresses: Addresses, model_path: str, launcher: str | None,
                            log_level: str = "INFO") -> None:
    """Entry point of the detokenizer process."""
    begin_stage_process(name, log_level, addresses, launcher)
    stop = stop_on_sigterm()
    serve_detokenizer(zmq.Context(), addresses, Detokenizer(load_tokenizer(model_path)), stop, launcher)
