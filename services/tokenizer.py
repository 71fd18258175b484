"""Tokenizer worker: chat template + tokenization + validation, N of them sharing the load.

Pulls GenerateReq from the ingress feed (ZeroMQ spreads requests over the workers), pushes
TokenizedReq to the engine, and sends errors straight back to the waiting ingress.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import zmq

from conveyor.engine.errors import ConveyorError, InvalidRequestError, PromptTooLongError, error_code
from conveyor.engine.llm_engine import validate_params
from conveyor.engine.weight_loader import load_model_config
from conveyor.protocol import (
    Addresses,
    Codec,
    DetokSpec,
    EngineIn,
    EngineParams,
    ErrorOut,
    GenerateReq,
    Ping,
    Stage,
    TokenizedReq,
    TokenizerIn,
)
from conveyor.services.chat_template import ChatTemplateConfig
from conveyor.services.stage import ReplySockets, announce_ready, setup_logging, stop_on_sigterm
from conveyor.services.tokenize import Preprocessor

logger = logging.getLogger(__name__)

PROMPT_TAIL = 8  # prompt tokens the detokenizer needs to render the first output token right


class TokenizerWorker:
    """Turns GenerateReq into TokenizedReq (or an ErrorOut for the ingress)."""

    def __init__(self, preprocessor: Preprocessor, session_len: int):
        self.pre = preprocessor
        self.session_len = session_len

    def prepare(self, req: GenerateReq) -> TokenizedReq:
        """Validate and tokenize; raises ConveyorError subclasses on bad input."""
        o = req.options
        if req.input_ids is not None:
            if not req.input_ids:
                raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
            ids = list(req.input_ids)
        elif req.messages is not None:
            ids = self.pre.encode(req.messages, req.do_preprocess, req.sequence_start)
        elif req.prompt is not None:
            ids = self.pre.encode(req.prompt, req.do_preprocess, req.sequence_start)
        else:
            raise InvalidRequestError("give a prompt, messages or input_ids", param="prompt")
        if len(ids) >= self.session_len:
            raise PromptTooLongError(len(ids), self.session_len)
        params, stops = self.pre.sampling_params(
            max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
            min_p=o.min_p, repetition_penalty=o.repetition_penalty, ignore_eos=o.ignore_eos,
            random_seed=o.seed, min_new_tokens=o.min_new_tokens, stop_words=o.stop, bad_words=o.bad_words,
            stop_token_ids=o.stop_token_ids, bad_token_ids=o.bad_token_ids, logprobs=o.logprobs)
        validate_params(params)
        if any(not s for s in stops):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        return TokenizedReq(
            rid=req.rid,
            token_ids=ids,
            params=EngineParams(**dataclasses.asdict(params)),  # same fields, wire form
            detok=DetokSpec(reply_to=req.reply_to, prompt_tail=ids[-PROMPT_TAIL:], stop=stops,
                            skip_special_tokens=o.skip_special_tokens, include_stop_str=o.include_stop_str),
            session_id=req.session_id,
        )


def serve_tokenizer(ctx: zmq.Context, addresses: Addresses, worker: TokenizerWorker,
                    stop: threading.Event, launcher: str | None = None) -> None:
    """The worker loop: blocks on its input, wakes every 0.5 s only to check ``stop``."""
    feed = ctx.socket(zmq.PULL)
    feed.setsockopt(zmq.LINGER, 0)
    feed.connect(addresses.tokenizer_in.connect)
    engine = ctx.socket(zmq.PUSH)
    engine.setsockopt(zmq.LINGER, 1000)
    engine.connect(addresses.engine_in.connect)
    replies = ReplySockets(ctx)
    in_codec, out_codec = Codec(TokenizerIn), Codec(EngineIn)
    announce_ready(ctx, launcher, Stage.TOKENIZER)
    busy, handled = 0.0, 0  # reported on Pings, for per-stage overhead measurements
    try:
        while not stop.is_set():
            if not feed.poll(500):
                continue
            try:
                msg = in_codec.recv(feed)
            except Exception:  # noqa: BLE001 - a malformed frame is dropped, the worker goes on
                logger.exception("undecodable request frame")
                continue
            if isinstance(msg, Ping):
                msg.stage_stats.update(tokenizer_busy_s=busy, tokenizer_requests=handled)
                out_codec.send(engine, msg)
                continue
            start = time.perf_counter()
            handled += 1
            try:
                out_codec.send(engine, worker.prepare(msg))
            except ConveyorError as exc:
                replies.send(msg.reply_to, ErrorOut(msg.rid, 400, str(exc), param=getattr(exc, "param", None), code=error_code(exc)))
            except Exception as exc:  # noqa: BLE001 - report, keep serving
                logger.exception("tokenizing request %s failed", msg.rid)
                replies.send(msg.reply_to, ErrorOut(msg.rid, 500, f"tokenizer error: {exc}", type="internal_error"))
            busy += time.perf_counter() - start
    finally:
        feed.close(linger=0)
        engine.close()
        replies.close()


def run_tokenizer_process(addresses: Addresses, model_path: str, session_len: int,
                          chat_template: str | None, launcher: str | None, log_level: str = "INFO") -> None:
    """Entry point of a tokenizer worker process."""
    setup_logging(log_level)
    stop = stop_on_sigterm()
    template = ChatTemplateConfig(model_name=chat_template) if chat_template else None
    eos = load_model_config(model_path).eos_token_ids
    worker = TokenizerWorker(Preprocessor(model_path, template, eos), session_len)
    serve_tokenizer(zmq.Context(), addresses, worker, stop, launcher)
