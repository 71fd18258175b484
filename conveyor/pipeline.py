"""The offline inference API, shaped like LMDeploy's ``pipeline()``."""

from __future__ import annotations

import base64
import io
import itertools
import logging
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.preflight import preflight
from conveyor.engine.weight_loader import load_model_config
from conveyor.messages import GenerationConfig, Response
from conveyor.protocol import EngineConfigError, GenerateReq, InvalidRequestError, rebuild_error
from conveyor.services.local_stack import EngineDiedError, LocalStack, RequestError, RequestOutput
from conveyor.services.tokenizer.chat_template import (
    ChatTemplateConfig,
    UnknownChatTemplateError,
    template_for_model_name,
)
from conveyor.services.tokenizer.images import LOCAL_IMAGE_LIMITS
from conveyor.services.tokenizer.preprocess import Preprocessor, Prompt

logger = logging.getLogger(__name__)


@dataclass
class Session:
    """A multi-turn conversation whose KV cache stays in the engine between turns."""

    session_id: int
    pipeline: "Pipeline"
    response: Response | None = None
    history: list[tuple[Any, str]] = field(default_factory=list)
    closed: bool = False

    def stop(self) -> None:
        """Stop the turn now streaming (it ends with finish_reason 'abort'); the session stays,
        with what was generated so far in its history (LMDeploy's ``Session.stop``)."""
        if not self.closed:
            self.pipeline.stop_session(self.session_id)

    def close(self) -> None:
        """Free the session's KV blocks; the object can no longer be used for chat."""
        if not self.closed:
            self.pipeline.end_session(self.session_id)
            self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# LMDeploy's older spellings of GenerationConfig fields, accepted as call arguments.
_OLD_NAMES = {"request_output_len": "max_new_tokens"}
# GenerationConfig fields that are the tokenizer stage's to fill, never a caller's.
_NOT_ARGUMENTS = ("bad_sequences",)


def _call_options(method: str, gen_config: GenerationConfig | None, kwargs: dict[str, Any],
                  allowed: tuple[str, ...] = ()) -> tuple[GenerationConfig, dict[str, Any]]:
    """The call's GenerationConfig and its other options (the names in ``allowed``), from
    ``gen_config`` or LMDeploy's older keyword arguments (``request_output_len=``, ``top_k=``,
    ... given to the call itself: each becomes the GenerationConfig field of that meaning).

    Nothing is swallowed: an argument conveyor does not know is a TypeError naming the fix, and so
    are sampling arguments given beside a ``gen_config`` (which one should win is the caller's call).
    """
    options, fields = {}, {}
    for name, value in kwargs.items():
        if name in allowed:
            options[name] = value
            continue
        field = _OLD_NAMES.get(name, name)
        if field not in GenerationConfig.__struct_fields__ or field in _NOT_ARGUMENTS:
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}; sampling settings go in "
                            f"gen_config=GenerationConfig(...), whose fields are "
                            f"{', '.join(f for f in GenerationConfig.__struct_fields__ if f not in _NOT_ARGUMENTS)}")
        if field in fields:
            raise TypeError(f"{method}() got {field} twice (request_output_len is max_new_tokens): give one")
        fields[field] = value
    if not fields:
        gen = gen_config or GenerationConfig()
    elif gen_config is not None:
        raise TypeError(f"{method}() got gen_config and {', '.join(kwargs)}: set "
                        f"{', '.join(fields)} in the GenerationConfig instead")
    else:
        gen = GenerationConfig(**fields)
    adapter = options.pop("adapter_name", None)
    if adapter is not None and adapter != gen.adapter_name:
        if gen.adapter_name is not None:
            raise InvalidRequestError(f"adapter_name={adapter!r} but gen_config.adapter_name="
                                      f"{gen.adapter_name!r}: name the LoRA adapter once", param="adapter_name")
        gen = msgspec.structs.replace(gen, adapter_name=adapter)
    return gen, options


def _is_single(prompts: Any) -> bool:
    """A string, a (text, images) tuple or one message list is one prompt; a list of those is a batch."""
    if isinstance(prompts, str | tuple):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(p, dict) for p in prompts)


def _image_part(image: Any) -> dict[str, Any]:
    """An image of a (text, image) prompt as an OpenAI ``image_url`` part: a PIL image goes as a
    PNG data URL (lossless: the tokenizer stage decodes the same pixels), a path or URL as is (the
    pipeline's own tokenizer stage may read local files; a server's never does)."""
    if isinstance(image, str | Path):
        return {"type": "image_url", "image_url": {"url": str(image)}}
    if isinstance(image, bytes | bytearray):
        return {"type": "image_url", "image_url": {"url": "data:image;base64," + base64.b64encode(image).decode()}}
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image (conveyor.vl.load_image's)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)  # lossless either way; level 1 is the fast one
        return {"type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}}
    raise InvalidRequestError(f"an image must be a PIL image, a path, a URL or bytes, got {type(image).__name__}",
                              param="prompts")


def _as_messages(prompt: Any) -> Prompt:
    """LMDeploy's vision prompt, ``(text, image)`` or ``(text, [images])``, as one user message
    (the images first, then the text, as vision chat templates lay them out); other prompts as is."""
    if not isinstance(prompt, tuple):
        return prompt
    if len(prompt) != 2 or not isinstance(prompt[0], str):
        raise InvalidRequestError("a vision prompt is a (text, image) or (text, [images]) tuple", param="prompts")
    text, images = prompt
    images = list(images) if isinstance(images, list | tuple) else [images]
    return [{"role": "user", "content": [*map(_image_part, images), {"type": "text", "text": text}]}]


# The options the calls take besides gen_config (and LMDeploy's older sampling arguments).
_CALL_OPTIONS = ("chat_template_kwargs", "use_tqdm", "adapter_name")


class Pipeline:
    """Batch, streaming and multi-turn inference on one engine running in a background thread."""

    def __init__(self, model_path: str | Path, backend_config: EngineConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None):
        self.backend_config = backend_config or EngineConfig()
        config = self.backend_config
        from conveyor.default_model import local_path

        # Path, config, weights' headers and tp split (engine/preflight.py), then tokenizer and
        # template, are checked before the weights load: bad settings fail in seconds, not after
        # the model is in memory.
        self.model_path = preflight(local_path(str(model_path)), config)
        model_config = load_model_config(self.model_path)
        self.session_len = config.session_len or model_config.max_position_embeddings
        # The caller's own files: paths in (text, image) prompts and image_url parts may be read.
        self.preprocessor = Preprocessor(self.model_path, self.session_len, chat_template_config,
                                         model_config.eos_token_ids, LOCAL_IMAGE_LIMITS)
        self.engine = LLMEngine(self.model_path, config)
        self.tokenizer = self.preprocessor.tokenizer
        # The same stage code and engine client as the server, as threads over inproc:// sockets.
        self._stack = LocalStack(self.engine, self.preprocessor)
        self._session_ids = itertools.count(1)

    # ---- requests -------------------------------------------------------------------------
    def _request(self, prompt: Prompt, gen: GenerationConfig, sample: int, do_preprocess: bool,
                 session_id: int | None, sequence_start: bool,
                 chat_template_kwargs: dict[str, Any] | None = None) -> GenerateReq:
        text, messages = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        return GenerateReq(self._stack.new_rid(), "", gen.sampling_params(sample), prompt=text, messages=messages,
                           do_preprocess=do_preprocess, session_id=session_id, sequence_start=sequence_start,
                           chat_template_kwargs=chat_template_kwargs or None)

    def _stream(self, prompts: list[Prompt], gen: GenerationConfig, do_preprocess: bool,
                session_id: int | None = None, sequence_start: bool = True,
                chat_template_kwargs: dict[str, Any] | None = None) -> Iterator[tuple[int, Response]]:
        """Yield (request tag, delta) as they come, for every (prompt, sample) of the call."""
        prompts = [_as_messages(p) for p in prompts]
        # Cheap checks first (no tokenization), so a malformed prompt fails the call before
        # anything is queued; lengths are checked by the tokenizer stage.
        for p in prompts:
            self.preprocessor.render(p, do_preprocess, sequence_start, chat_template_kwargs)
        out: queue.Queue[tuple[int, RequestOutput | RequestError]] = queue.Queue()
        live: dict[int, Response] = {}
        rids: list[str] = []
        try:
            for index, prompt in enumerate(prompts):
                for sample in range(gen.n):
                    req = self._request(prompt, gen, sample, do_preprocess, session_id, sequence_start,
                                        chat_template_kwargs)
                    tag = len(live)
                    rids.append(req.rid)
                    self._stack.submit(req, out, tag)
                    live[tag] = Response("", 0, 0, session_id if session_id is not None else index, index=index)
            remaining = len(live)
            while remaining:
                tag, item = out.get()
                if isinstance(item, RequestError):
                    if item.status == 503:
                        raise EngineDiedError(item.message)
                    raise rebuild_error(item.message, item.param, item.code)
                state = live[tag]
                state.generate_token_len = item.completion_tokens
                yield tag, Response(item.text, item.completion_tokens, item.prompt_tokens, state.session_id,
                                    item.finish_reason, list(item.token_ids), item.logprobs, state.index,
                                    item.cached_tokens)
                if item.finish_reason is not None:
                    remaining -= 1
        finally:
            # A consumer that stops early (break, exception) must not leave work in the engine.
            self._stack.abort(rids)

    def __call__(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | None = None,
                 do_preprocess: bool = True, **kwargs: Any) -> Response | list[Response]:
        """Generate for one prompt (returns a Response) or a batch (returns a list).

        With ``n > 1`` each prompt gives ``n`` responses, in prompt order. Keyword arguments:
        ``chat_template_kwargs`` (the chat template's extra variables, e.g. ``enable_thinking=False``
        for Qwen3), ``use_tqdm`` (a progress bar), ``adapter_name`` (the LoRA adapter to run with, one of
        ``backend_config.adapters``' names; None: the base model), and LMDeploy's older
        sampling arguments (``request_output_len``, ``top_k``, ...) instead of ``gen_config``.
        """
        gen, options = _call_options("__call__", gen_config, kwargs, _CALL_OPTIONS)
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidRequestError("no prompts given", param="prompts")
        bar = None
        if options.get("use_tqdm"):
            from tqdm import tqdm

            bar = tqdm(total=len(batch) * gen.n, desc="generating")
        merged: dict[int, Response] = {}  # request tag -> accumulated response
        try:
            for tag, r in self._stream(batch, gen, do_preprocess,
                                       chat_template_kwargs=options.get("chat_template_kwargs")):
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
                    if bar is not None:
                        bar.update()
        finally:
            if bar is not None:
                bar.close()
        results = [merged[tag] for tag in sorted(merged)]  # tags follow prompt, then sample order
        return results[0] if single and gen.n == 1 else results

    def infer(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | None = None,
              do_preprocess: bool = True, **kwargs: Any) -> Response | list[Response]:
        """LMDeploy's name for calling the pipeline: the same as ``pipe(prompts, ...)``."""
        return self(prompts, gen_config, do_preprocess, **kwargs)

    def batch_infer(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | None = None,
                    do_preprocess: bool = True, **kwargs: Any) -> Response | list[Response]:
        """LMDeploy's older name for calling the pipeline: the same as ``pipe(prompts, ...)``."""
        return self(prompts, gen_config, do_preprocess, **kwargs)

    def stream_infer(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | None = None,
                     do_preprocess: bool = True, **kwargs: Any) -> Iterator[Response]:
        """Yield Responses whose ``text`` is the new part; ``index`` says which prompt. Keyword
        arguments as ``__call__``'s (``stream_response`` only True)."""
        gen, options = _call_options("stream_infer", gen_config, kwargs, ("chat_template_kwargs", "adapter_name",
                                                                          "stream_response"))
        if options.get("stream_response", True) is not True:
            raise TypeError("stream_infer() streams; for whole responses call the pipeline (pipe(prompts, ...))")
        batch = [prompts] if _is_single(prompts) else list(prompts)
        return self._stream_infer(batch, gen, do_preprocess, options.get("chat_template_kwargs"))

    def _stream_infer(self, batch: list[Prompt], gen: GenerationConfig, do_preprocess: bool,
                      chat_template_kwargs: dict[str, Any] | None) -> Iterator[Response]:
        for _, r in self._stream(batch, gen, do_preprocess, chat_template_kwargs=chat_template_kwargs):
            yield r

    # ---- sessions ---------------------------------------------------------------------------
    def chat(self, prompt: Prompt, session: Session | None = None, gen_config: GenerationConfig | None = None,
             stream_response: bool = False, do_preprocess: bool = True, **kwargs: Any) -> Session | Iterator[Response]:
        """One turn of a multi-turn chat; the engine keeps the history as KV between turns.
        Keyword arguments as ``__call__``'s (``chat_template_kwargs``, LMDeploy's older sampling ones)."""
        gen, options = _call_options("chat", gen_config, kwargs, ("chat_template_kwargs", "adapter_name"))
        if gen.n != 1:
            raise InvalidRequestError("chat() generates one response per turn: use n=1", param="n")
        session = session or self.session()
        start = not session.history  # the first turn renders the system prompt
        if session.closed:
            raise InvalidRequestError("this session was closed: start a new one with session=None")
        stream = self._stream([prompt], gen, do_preprocess, session.session_id, sequence_start=start,
                              chat_template_kwargs=options.get("chat_template_kwargs"))
        if stream_response:
            return self._chat_stream(stream, session, prompt)
        text, ids, logprobs, last = "", [], [], None
        for _, r in stream:
            text += r.text
            ids += r.token_ids
            logprobs += r.logprobs or []
            last = r
        session.response = replace(last, text=text, token_ids=ids, logprobs=logprobs or None)
        session.history.append((prompt, text))
        return session

    @staticmethod
    def _chat_stream(stream: Iterator[tuple[int, Response]], session: Session, prompt: Prompt) -> Iterator[Response]:
        text, started = "", False
        try:
            for _, r in stream:
                text, started = text + r.text, True
                session.response = r
                yield r
        finally:  # a turn stopped early (Ctrl-C in chat, a break) is still in the engine's history
            stream.close()  # aborts the request now, if it still runs (and waits until it has)
            if started:
                session.history.append((prompt, text))

    def session(self) -> Session:
        """A new, empty session to pass to ``chat``."""
        return Session(next(self._session_ids), self)

    def stop_session(self, session_id: int) -> None:
        """Abort a session's running turn, if any (done when this returns); the session stays. A
        turn the engine has not admitted yet is not stopped: call again once it streams."""
        self._stack.call(lambda engine: engine.abort_session(session_id))

    def end_session(self, session_id: int) -> None:
        """Release a session's KV blocks."""
        self._stack.end_session(session_id)

    # ---- scoring ---------------------------------------------------------------------------
    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """Mean cross-entropy loss per token sequence (exp() of it is the perplexity)."""
        if input_ids and isinstance(input_ids[0], int):
            input_ids = [input_ids]
        return self._stack.call(lambda engine: engine.get_ppl(input_ids))

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread and free the model and KV cache memory."""
        if self._stack is None:
            return
        self._stack.close()
        self._stack = None
        self.engine.close()  # tensor parallel: stops the other ranks
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


def pipeline(model_path: str | Path, *args: Any, backend_config: EngineConfig | None = None,
             chat_template_config: ChatTemplateConfig | None = None, log_level: str = "WARNING",
             model_name: str | None = None, tp: int | None = None) -> Pipeline:
    """Load a model (HF directory, .gguf file or hub id) and return a ready Pipeline.

    Positional arguments follow LMDeploy's two signatures: ``(backend_config, chat_template_config,
    log_level)``, or, when the first is a string, the older ``(model_name, backend_config,
    chat_template_config, log_level)``. A model name (``pipeline(path, 'internlm2-chat-7b')`` or
    ``model_name=``) picks the built-in chat template of that name or family, unless
    ``chat_template_config`` is given. ``tp`` is ``backend_config.tp``'s shorthand."""
    names = (["model_name"] if args and isinstance(args[0], str) else []) + [
        "backend_config", "chat_template_config", "log_level"]
    if len(args) > len(names):
        raise TypeError(f"pipeline() takes at most {len(names) + 1} positional arguments")
    given = dict(zip(names, args))
    for name, value in (("model_name", model_name), ("backend_config", backend_config),
                        ("chat_template_config", chat_template_config)):
        if name in given and value is not None:
            raise TypeError(f"pipeline() got {name} both by position and by keyword")
    model_name = given.get("model_name", model_name)
    backend_config = given.get("backend_config", backend_config)
    chat_template_config = given.get("chat_template_config", chat_template_config)
    logging.getLogger("conveyor").setLevel(given.get("log_level", log_level).upper())
    if model_name and chat_template_config is None:
        chat_template_config = template_for_model_name(model_name)
        if chat_template_config is None:
            raise UnknownChatTemplateError(
                f"model name {model_name!r} names no built-in chat template or family (conveyor list); "
                "leave it out to use the model's own template, or give one (chat_template_config=, --chat-template)")
    if tp is not None:
        if backend_config is not None and backend_config.tp not in (1, tp):
            raise EngineConfigError(f"tp={tp} and backend_config.tp={backend_config.tp}: give one")
        backend_config = replace(backend_config or EngineConfig(), tp=tp)
    return Pipeline(model_path, backend_config, chat_template_config)
