"""Detokenizer stage: token ids in (one TokenBatch per engine step), text out to each ingress.

Keeps one IncrementalDetokenizer per live request (UTF-8 safe, holds back a possible stop
string). When a stop string completes, the request is answered as finished at once and the
engine is told to stop it; tokens the engine produced meanwhile are dropped. The state map is
capped: past the cap the least recently active request is failed rather than memory growing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from conveyor.protocol import (
    Addresses,
    Codec,
    DetokenizerIn,
    EngineIn,
    ErrorOut,
    Finish,
    LoadReport,
    NewRequest,
    Stage,
    StopReq,
    TextBatch,
    TokenBatch,
)
from conveyor.services.detokenize import IncrementalDetokenizer
from conveyor.services.stage import ReplySockets, announce_ready, setup_logging, stop_on_sigterm
from conveyor.services.tokenize import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _State:
    detok: IncrementalDetokenizer
    reply_to: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached: int = 0


@dataclass
class _Outgoing:
    """A TextBatch being built for one ingress."""

    rids: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    prompt_tokens: list = field(default_factory=list)
    completion_tokens: list = field(default_factory=list)
    cached: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    any_logprobs: bool = False

    def add(self, rid: str, st: _State, text: str, ids: list[int], finish: int, lp) -> None:
        self.rids.append(rid)
        self.texts.append(text)
        self.token_ids.append(ids)
        self.finish.append(finish)
        self.prompt_tokens.append(st.prompt_tokens)
        self.completion_tokens.append(st.completion_tokens)
        self.cached.append(st.cached)
        self.logprobs.append(lp)
        self.any_logprobs |= lp is not None

    def build(self) -> TextBatch:
        return TextBatch(self.rids, self.texts, self.token_ids, self.finish, self.prompt_tokens,
                         self.completion_tokens, self.cached, self.logprobs if self.any_logprobs else None)


class Detokenizer:
    """Turns TokenBatches into per-ingress TextBatches; pure logic, no sockets."""

    def __init__(self, tokenizer, max_states: int = 65_536):
        self.tokenizer = tokenizer
        self.max_states = max_states
        self.states: OrderedDict[str, _State] = OrderedDict()

    def process(self, batch: TokenBatch) -> tuple[dict[str, TextBatch], list[ErrorOut], list[str]]:
        """Returns (TextBatch per reply address, errors to deliver, rids the engine must stop)."""
        out: dict[str, _Outgoing] = {}
        errors: list[ErrorOut] = []
        stops: list[str] = []
        for new in batch.new:
            errors += self._admit(new, out)
        for err in batch.errors:
            st = self.states.pop(err.rid, None)
            if st is not None and not err.reply_to:
                err.reply_to = st.reply_to
            errors.append(err)
        for i, rid in enumerate(batch.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # already answered (stop string) or evicted
            self.states.move_to_end(rid)
            token = batch.tokens[i]
            ids = [token] if token >= 0 else []
            st.completion_tokens += len(ids)
            st.cached = batch.cached[i]
            res = st.detok.step(ids)
            finish = batch.finish[i]
            lp = None
            if batch.logprobs is not None and ids:
                entry = dict(batch.top_logprobs[i]) if batch.top_logprobs else {}
                entry[token] = batch.logprobs[i]
                lp = [entry]
            if res.stopped and finish < 0:
                finish = int(Finish.STOP)
                stops.append(rid)
            if finish >= 0:
                text = res.text + (st.detok.finish() if not res.stopped else "")
                del self.states[rid]
            else:
                text = res.text
            out.setdefault(st.reply_to, _Outgoing()).add(rid, st, text, ids, finish, lp)
        return {addr: o.build() for addr, o in out.items()}, errors, stops

    def _admit(self, new: NewRequest, out: dict[str, _Outgoing]) -> list[ErrorOut]:
        d = new.detok
        detok = IncrementalDetokenizer(self.tokenizer, d.prompt_tail, d.skip_special_tokens, d.stop, d.include_stop_str)
        st = _State(detok, d.reply_to, new.num_prompt_tokens)
        self.states[new.rid] = st
        # An empty, unfinished entry tells the ingress its request reached the engine.
        out.setdefault(d.reply_to, _Outgoing()).add(new.rid, st, "", [], -1, None)
        errors = []
        while len(self.states) > self.max_states:
            rid, old = self.states.popitem(last=False)
            logger.error("detokenizer state cap %d reached: failing request %s", self.max_states, rid)
            errors.append(ErrorOut(rid, 503, "the server is overloaded (detokenizer state cap); retry later",
                                   type="service_unavailable", reply_to=old.reply_to))
        return errors


def serve_detokenizer(ctx: zmq.Context, addresses: Addresses, detok: Detokenizer, stop: threading.Event,
                      launcher: str | None = None) -> None:
    """The stage loop: blocks on its input, wakes every 0.5 s only to check ``stop``."""
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.bind(addresses.detokenizer_in.bind)
    engine = ctx.socket(zmq.PUSH)
    engine.setsockopt(zmq.LINGER, 0)
    engine.connect(addresses.engine_in.connect)
    replies = ReplySockets(ctx)
    in_codec, engine_codec = Codec(DetokenizerIn), Codec(EngineIn)
    announce_ready(ctx, launcher, Stage.DETOKENIZER)
    busy, tokens = 0.0, 0  # reported on LoadReports, for per-stage overhead measurements
    try:
        while not stop.is_set():
            if not inbox.poll(500):
                continue
            for msg in in_codec.recv_all(inbox):
                if isinstance(msg, LoadReport):
                    msg.stage_stats.update(detokenizer_busy_s=busy, detokenizer_tokens=tokens)
                    replies.send(msg.reply_to, msg)
                    continue
                start = time.perf_counter()
                tokens += len(msg.rids)
                batches, errors, stops = detok.process(msg)
                for rid in stops:
                    engine_codec.send(engine, StopReq(rid))
                for addr, tb in batches.items():
                    replies.send(addr, tb)
                for err in errors:
                    if err.reply_to:
                        replies.send(err.reply_to, err)
                    if err.status == 503:
                        engine_codec.send(engine, StopReq(err.rid))
                busy += time.perf_counter() - start
    finally:
        inbox.close(linger=0)
        engine.close(linger=0)
        replies.close()


def run_detokenizer_process(addresses: Addresses, model_path: str, launcher: str | None,
                            log_level: str = "INFO") -> None:
    """Entry point of the detokenizer process."""
    setup_logging(log_level)
    stop = stop_on_sigterm()
    serve_detokenizer(zmq.Context(), addresses, Detokenizer(load_tokenizer(model_path)), stop, launcher)
