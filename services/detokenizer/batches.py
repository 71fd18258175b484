"""The detokenizer stage's logic: per-step TokenBatches in, per-ingress TextBatches out.

Keeps one IncrementalDetokenizer per live request (UTF-8 safe, holds back a possible stop
string), from the engine's Admitted message to the request's finish. When a stop string
completes, the request is answered as finished at once and the engine is told to stop it;
tokens the engine produced meanwhile are dropped. The state map is capped: past the cap the
least recently active request is failed rather than memory growing. A malformed Admitted or
TokenBatch (``protocol/checks.py``) raises MalformedMessageError before any state changes, so
the process loop drops it whole. No sockets here: the process loop is ``process.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from ...protocol import Admitted, ErrorOut, Finish, TextBatch, TokenBatch
from ...protocol.checks import check_admitted, check_token_batch
from .incremental import IncrementalDetokenizer

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
        self.vocab_size = len(tokenizer)  # ids past it decode to no text (IncrementalDetokenizer)
        self.max_states = max_states
        self.states: OrderedDict[str, _State] = OrderedDict()

    def admit(self, new: Admitted) -> list[ErrorOut]:
        """Start a request's state; returns the requests failed to keep under the state cap.
        Raises MalformedMessageError, changing nothing, if ``new`` is malformed."""
        check_admitted(new)
        p = new.detokenize
        detok = IncrementalDetokenizer(self.tokenizer, new.prompt_tail, p.skip_special_tokens, p.stop_words,
                                       p.include_stop_str_in_output, self.vocab_size)
        self.states[new.rid] = _State(detok, new.reply_to, new.num_prompt_tokens)
        errors = []
        while len(self.states) > self.max_states:
            rid, old = self.states.popitem(last=False)
            logger.error("detokenizer state cap %d reached: failing request %s", self.max_states, rid)
            errors.append(ErrorOut(rid, 503, "the server is overloaded (detokenizer state cap); retry later",
                                   type="service_unavailable", reply_to=old.reply_to))
        return errors

    def process(self, batch: TokenBatch) -> tuple[dict[str, TextBatch], list[str]]:
        """Returns (TextBatch per reply address, rids the engine must stop: a stop string).
        Raises MalformedMessageError, changing nothing, if ``batch`` is malformed."""
        check_token_batch(batch)
        out: dict[str, _Outgoing] = {}
        stops: list[str] = []
        for i, rid in enumerate(batch.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # already answered (stop string) or evicted
            self.states.move_to_end(rid)
            token = batch.tokens[i]
            ids = [token] if token != -1 else []
            st.completion_tokens += len(ids)
            st.cached = batch.cached[i]
            finish = batch.finish[i]
            # A turn the engine ended with STOP and a token ended on a stop token id: it counts as
            # generated but is not text (as vLLM; with skip_special_tokens off, <|im_end|> would
            # show), unless include_stop_str_in_output asks for stops in the output.
            ended_on_stop_token = finish == Finish.STOP and ids and not st.detok.include_stop_str
            res = st.detok.step([] if ended_on_stop_token else ids)
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
        return {addr: o.build() for addr, o in out.items()}, stops
