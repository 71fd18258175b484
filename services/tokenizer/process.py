"""The tokenizer worker's process loop: N workers share the ingress feed (ZeroMQ spreads it).

Pulls GenerateReq, pushes the TokenizedReq that ``Preprocessor.prepare`` makes to the engine,
and sends a refusal (ErrorOut) straight back to the waiting ingress.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import zmq

from ...engine.hf_config import config_eos_ids
from ...protocol import Addresses, Codec, ConveyorError, EngineIn, ErrorOut, Ping, Stage, TokenizerIn, error_code
from ..stage import (SEND_TIMEOUT_MS, ReplySockets, announce_ready, begin_stage_process, internal_error, open_socket,
                     stop_on_sigterm)
from .chat_template import template_config
from .images import ImageLimits
from .preprocess import Preprocessor

logger = logging.getLogger(__name__)


def serve_tokenizer(ctx: zmq.Context, addresses: Addresses, pre: Preprocessor,
                    stop: threading.Event, launcher: str | None = None) -> None:
    """The worker loop: blocks on its input, wakes every 0.5 s only to check ``stop``."""
    feed = open_socket(ctx, zmq.PULL, connect=addresses.tokenizer_in.connect, curve=addresses.curve)
    engine = open_socket(ctx, zmq.PUSH, connect=addresses.engine_in.connect, linger_ms=1000,
                         send_timeout_ms=SEND_TIMEOUT_MS, curve=addresses.curve)
    replies = ReplySockets(ctx, addresses)
    in_codec, out_codec = Codec(TokenizerIn), Codec(EngineIn)
    announce_ready(ctx, launcher, Stage.TOKENIZER, addresses)
    busy, handled = 0.0, 0  # reported on Pings, for per-stage overhead measurements
    try:
        while not stop.is_set():
            if not feed.poll(500):
                continue
            for msg in in_codec.recv_all(feed):
                if isinstance(msg, Ping):
                    msg.stage_stats.update(tokenizer_busy_s=busy, tokenizer_requests=handled,
                                           tokenizer_bad_frames=in_codec.dropped,
                                           tokenizer_refused_replies=replies.refused)
                    with contextlib.suppress(zmq.Again):  # no engine: the ring's silence says so
                        out_codec.send(engine, msg)
                    continue
                start = time.perf_counter()
                handled += 1
                try:
                    out_codec.send(engine, pre.prepare(msg))
                except zmq.Again:
                    replies.send(msg.reply_to, ErrorOut(msg.rid, 503, "the engine is not taking requests; retry later",
                                                        type="service_unavailable", code="engine_unavailable"))
                except ConveyorError as exc:
                    replies.send(msg.reply_to, ErrorOut(msg.rid, 400, str(exc), param=getattr(exc, "param", None),
                                                        code=error_code(exc)))
                except Exception:  # report, keep serving; the details stay in the log
                    logger.exception("tokenizing request %s failed", msg.rid)
                    replies.send(msg.reply_to, internal_error(msg.rid, "tokenizer"))
                busy += time.perf_counter() - start
    finally:
        feed.close(linger=0)
        engine.close()
        replies.close()


def run_tokenizer_process(name: str, addresses: Addresses, model_path: str, session_len: int,
                          chat_template: str | None, launcher: str | None, log_level: str = "INFO",
                          image_limits: ImageLimits | None = None) -> None:
    """Entry point of a tokenizer worker process."""
    begin_stage_process(name, log_level, addresses, launcher)
    stop = stop_on_sigterm()
    template = template_config(chat_template)
    eos = config_eos_ids(model_path)  # plain JSON: this stage needs no model code, nor torch
    pre = Preprocessor(model_path, session_len, template, eos, image_limits)
    serve_tokenizer(zmq.Context(), addresses, pre, stop, launcher)
