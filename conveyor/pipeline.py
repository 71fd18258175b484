"""The offline inference API, shaped like LMDeploy's ``pipeline()``."""

from __future__ import annotations

import itertools
import logging
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import InvalidRequestError, PromptTooLongError
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.weight_loader import load_model_config, resolve_model_path
from conveyor.engine_thread import Delta, EngineThread
from conveyor.messages import GenerationConfig, Response
from conveyor.services.chat_template import ChatTemplateConfig
from conveyor.services.tokenize import Preprocessor, Prompt

logger = logging.getLogger(__name__)


@dataclass
class Session:
    """A multi-turn conversation whose KV cache stays in the engine between turns."""

    session_id: int
    pipeline: "Pipeline"
    response: Response | None = None
    history: list[tuple[Any, str]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        """Free the session's KV blocks; the object can no longer be used for chat."""
        if not self.closed:
            self.pipeline.end_session(self.session_id)
            self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_single(prompts: Any) -> bool:
    """A string or one message list is one prompt; a list of those is a batch."""
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(p, dict) for p in prompts)


class Pipeline:
    """Batch, streaming and multi-turn inference on one engine running in a background thread."""

    def __init__(self, model_path: str | Path, backend_config: EngineConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None):
        self.backend_config = backend_config or EngineConfig()
        self.model_path = resolve_model_path(model_path, self.backend_config.revision)
        # Tokenizer, template and architecture are checked before the weights load: bad
        # settings fail in a second, not after the model is in memory.
        model_config = load_model_config(self.model_path)
        self.preprocessor = Preprocessor(self.model_path, chat_template_config, model_config.eos_token_ids)
        self.engine = LLMEngine(self.model_path, self.backend_config)
        self.tokenizer = self.preprocessor.tokenizer
        self.session_len = self.engine.session_len
        self._thread = EngineThread(self.engine, self.tokenizer)
        self._ids = itertools.count()
        self._session_ids = itertools.count(1)

    # ---- requests -------------------------------------------------------------------------
    def _submit(self, token_ids: list[int], gen: GenerationConfig, out: queue.Queue, sample: int,
                session_id: int | None = None) -> int:
        seed = None if gen.random_seed is None else gen.random_seed + sample
        params, stops = self.preprocessor.sampling_params(
            max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
            top_p=gen.top_p, min_p=gen.min_p, repetition_penalty=gen.repetition_penalty,
            ignore_eos=gen.ignore_eos, random_seed=seed, min_new_tokens=gen.min_new_tokens,
            stop_words=gen.stop_words, bad_words=gen.bad_words, stop_token_ids=gen.stop_token_ids,
            bad_token_ids=gen.bad_token_ids, logprobs=gen.logprobs)
        seq_id = next(self._ids)
        self._thread.submit(seq_id, token_ids, params, stops, gen.skip_special_tokens,
                            gen.include_stop_str_in_output, out, session_id)
        return seq_id

    def _encode_all(self, prompts: list[Prompt], do_preprocess: bool) -> list[list[int]]:
        """Tokenize every prompt first, so a bad one fails the call before anything is queued."""
        encoded = []
        for p in prompts:
            ids = self.preprocessor.encode(p, do_preprocess)
            if len(ids) >= self.session_len:
                raise PromptTooLongError(len(ids), self.session_len)
            encoded.append(ids)
        return encoded

    def _stream(self, prompts: list[Prompt], gen: GenerationConfig, do_preprocess: bool,
                session_id: int | None = None, sequence_start: bool = True) -> Iterator[tuple[int, Response]]:
        """Yield (request tag, delta) as they come, for every (prompt, sample) of the call."""
        if session_id is None:
            encoded = self._encode_all(prompts, do_preprocess)
        else:
            encoded = [self.preprocessor.encode(prompts[0], do_preprocess, sequence_start)]
        out: queue.Queue[tuple[int, Delta]] = queue.Queue()
        live: dict[int, Response] = {}
        submitted: list[int] = []
        try:
            for index, ids in enumerate(encoded):
                for sample in range(gen.n):
                    tagged = _TaggedQueue(out, len(live))
                    seq_id = self._submit(ids, gen, tagged, sample, session_id)
                    submitted.append(seq_id)
                    live[tagged.tag] = Response("", 0, len(ids), session_id if session_id is not None else index,
                                                index=index)
            remaining = len(live)
            while remaining:
                tag, delta = out.get()
                if delta.error is not None:
                    raise delta.error
                state = live[tag]
                state.generate_token_len += len(delta.token_ids)
                yield tag, Response(delta.text, state.generate_token_len, state.input_token_len, state.session_id,
                               delta.finish_reason, delta.token_ids, delta.logprobs, state.index,
                               delta.num_cached_tokens)
                if delta.finish_reason is not None:
                    remaining -= 1
        finally:
            # A consumer that stops early (break, exception) must not leave work in the engine.
            for seq_id in submitted:
                try:
                    self._thread.abort(seq_id)
                except Exception:  # noqa: BLE001 - closing; nothing to report to
                    pass

    def __call__(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | None = None,
                 do_preprocess: bool = True, **kwargs: Any) -> Response | list[Response]:
        """Generate for one prompt (returns a Response) or a batch (returns a list).

        With ``n > 1`` each prompt gives ``n`` responses, in prompt order.
        """
        gen = gen_config or GenerationConfig()
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidRequestError("no prompts given", param="prompts")
        merged: dict[int, Response] = {}  # request tag -> accumulated response
        for tag, r in self._stream(batch, gen, do_preprocess):
            if tag not in merged:
                merged[tag] = replace(r, text="", token_ids=[], logprobs=None, finish_reason=None)
            acc = merged[tag]
            acc.text += r.text
            acc.token_ids += r.token_ids
            acc.generate_token_len = r.generate_token_len
            acc.num_cached_tokens = r.num_cached_tokens
            if r.logprobs:
                acc.logprobs = (acc.logprobs or []) + r.logprobs
            if r.finish_reason is not None:
                acc.finish_reason = r.finish_reason
        results = [merged[tag] for tag in sorted(merged)]  # tags follow prompt, then sample order
        return results[0] if single and gen.n == 1 else results

    def stream_infer(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | None = None,
                     do_preprocess: bool = True, **kwargs: Any) -> Iterator[Response]:
        """Yield Responses whose ``text`` is the new part; ``index`` says which prompt."""
        gen = gen_config or GenerationConfig()
        batch = [prompts] if _is_single(prompts) else list(prompts)
        for _, r in self._stream(batch, gen, do_preprocess):
            yield r

    # ---- sessions ---------------------------------------------------------------------------
    def chat(self, prompt: Prompt, session: Session | None = None, gen_config: GenerationConfig | None = None,
             stream_response: bool = False, do_preprocess: bool = True, **kwargs: Any) -> Session | Iterator[Response]:
        """One turn of a multi-turn chat; the engine keeps the history as KV between turns."""
        gen = gen_config or GenerationConfig()
        if gen.n != 1:
            raise InvalidRequestError("chat() generates one response per turn: use n=1", param="n")
        session = session or self.session()
        start = not session.history  # the first turn renders the system prompt
        if session.closed:
            raise InvalidRequestError("this session was closed: start a new one with session=None")
        stream = self._stream([prompt], gen, do_preprocess, session.session_id, sequence_start=start)
        if stream_response:
            return self._chat_stream(stream, session, prompt)
        text, ids, last = "", [], None
        for _, r in stream:
            text += r.text
            ids += r.token_ids
            last = r
        session.response = replace(last, text=text, token_ids=ids)
        session.history.append((prompt, text))
        return session

    @staticmethod
    def _chat_stream(stream: Iterator[tuple[int, Response]], session: Session, prompt: Prompt) -> Iterator[Response]:
        text = ""
        for _, r in stream:
            text += r.text
            session.response = r
            yield r
        session.history.append((prompt, text))

    def session(self) -> Session:
        """A new, empty session to pass to ``chat``."""
        return Session(next(self._session_ids), self)

    def end_session(self, session_id: int) -> None:
        """Release a session's KV blocks."""
        self._thread.call(lambda engine: engine.end_session(session_id))

    # ---- scoring ---------------------------------------------------------------------------
    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """Mean cross-entropy loss per token sequence (exp() of it is the perplexity)."""
        if input_ids and isinstance(input_ids[0], int):
            input_ids = [input_ids]
        return self._thread.call(lambda engine: engine.get_ppl(input_ids))

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread and free the model and KV cache memory."""
        if self._thread is None:
            return
        self._thread.close()
        self._thread = None
        self.engine = None
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TaggedQueue:
    """Puts (tag, delta) on a shared queue, so one reader can follow many requests."""

    def __init__(self, q: queue.Queue, tag: int):
        self.q, self.tag = q, tag

    def put(self, item: Delta) -> None:
        self.q.put((self.tag, item))


def pipeline(model_path: str | Path, backend_config: EngineConfig | None = None,
             chat_template_config: ChatTemplateConfig | None = None, log_level: str = "WARNING",
             **kwargs: Any) -> Pipeline:
    """Load a model (HF directory, .gguf file or hub id) and return a ready Pipeline."""
    logging.getLogger("conveyor").setLevel(log_level.upper())
    if kwargs.get("tp") and backend_config is None:
        backend_config = EngineConfig(tp=kwargs["tp"])
    return Pipeline(model_path, backend_config, chat_template_config)
