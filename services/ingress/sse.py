"""Turning engine outputs into HTTP responses: SSE chunks, NDJSON lines, whole JSON bodies.

``iter_choices`` merges the output streams of a request's choices (n > 1, or a batch of
completion prompts). A ``ResponseFormat`` renders those outputs for one endpoint, either as
stream pieces or accumulated into one body; ``stream_body`` drives a format for a streamed
response, ending a stream that fails midway with an error event rather than a cut connection.
Chunks are written as bytes directly (a fixed JSON head per response, then the choices),
matching OpenAI's chunk shapes field for field.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from ...protocol import GenerateReq
from ..engine_client import RequestError, RequestOutput
from ..http import SSE_DONE, error_envelope, sse_error
from .metrics import RequestStats
from .tool_calling import ChoiceParser
from .tool_parsers import finish_reason as tool_finish_reason

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
LOGPROB_FLOOR = -9999.0  # the chosen token's logprob when the engine did not report it (OpenAI's floor)

Event = tuple[int, RequestOutput]


# ---- merging choices ---------------------------------------------------------------------------

async def iter_choices(client: Any, reqs: list[GenerateReq], stats: list[RequestStats]) -> AsyncIterator[Event]:
    """Yield ``(choice index, output)`` from every request as outputs arrive.

    Closing this generator early (client gone) closes every engine stream, which makes the
    engine client abort those requests. The first RequestError of any choice is raised here and
    the other choices are aborted.
    """
    if len(reqs) == 1:  # the common case: no tasks, no queue
        agen = client.generate(reqs[0])
        try:
            async for out in agen:
                stats[0].observe(out)
                yield 0, out
        except Exception:
            stats[0].failed = True
            raise
        finally:
            await agen.aclose()
            stats[0].close()
        return

    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerateReq) -> None:
        agen = client.generate(req)
        try:
            async for out in agen:
                queue.put_nowait((i, out, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))
        finally:
            await agen.aclose()
        queue.put_nowait((i, None, None))  # this choice is done

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        remaining = len(reqs)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                stats[i].failed = True
                raise exc
            if out is None:
                remaining -= 1
                continue
            stats[i].observe(out)
            yield i, out
    finally:
        for task in tasks:
            task.cancel()  # a pump being cancelled closes its engine stream: the engine aborts it
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in stats:
            s.close()


def usage_dict(stats: list[RequestStats], n: int) -> dict[str, Any]:
    """OpenAI usage of choices grouped n per prompt: each prompt counts once, every choice's output."""
    firsts = stats[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


# ---- logprobs ----------------------------------------------------------------------------------

class LogprobRenderer:
    """Renders the engine's per-token ``{token_id: logprob}`` maps in OpenAI's two shapes.

    Token strings come from ``tokenizer.decode([id])`` (byte-level BPE keeps leading spaces; a
    lone piece of a multi-byte character shows as U+FFFD); without a tokenizer a token is shown
    as its id, e.g. "1234".
    """

    def __init__(self, tokenizer: Any | None = None):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The text of one token."""
        text = self._cache.get(token_id)
        if text is None:
            text = str(token_id) if self._tokenizer is None else self._tokenizer.decode([token_id])
            if len(self._cache) < 1 << 17:
                self._cache[token_id] = text
        return text

    @staticmethod
    def _top(lps: dict[int, float], k: int) -> list[tuple[int, float]]:
        # The map holds the top k plus the chosen token; the chosen one, when outside the top k,
        # sorts last and is cut here, as OpenAI's top lists hold exactly the k best.
        return sorted(lps.items(), key=lambda kv: -kv[1])[:k] if k else []

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, k: int) -> list[dict[str, Any]]:
        """Chat shape: one ``{token, logprob, bytes, top_logprobs}`` per token."""
        entries = []
        for tid, lps in zip(token_ids, logprobs or ()):
            text = self.token(tid)
            entries.append({
                "token": text, "logprob": lps.get(tid, LOGPROB_FLOOR), "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self.token(a)), "logprob": b, "bytes": list(t.encode())}
                                 for a, b in self._top(lps, k)],
            })
        return entries

    def completion(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, k: int,
                   text: str, offset: int) -> dict[str, list[Any]]:
        """Legacy completions shape for tokens whose text is ``text`` starting at ``offset``."""
        tokens, token_lps, tops, offsets = [], [], [], []
        pos, end = offset, offset + len(text)
        for tid, lps in zip(token_ids, logprobs or ()):
            tok = self.token(tid)
            lp = lps.get(tid, LOGPROB_FLOOR)
            top = {self.token(a): b for a, b in self._top(lps, k)}
            top.setdefault(tok, lp)  # the sampled token is always listed (up to k + 1 entries)
            tokens.append(tok)
            token_lps.append(lp)
            tops.append(top)
            offsets.append(min(pos, end))  # stop strings and held bytes make token text != delta text
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# ---- formats -----------------------------------------------------------------------------------

class ResponseFormat:
    """Renders one endpoint's outputs: ``on_output``/``closing`` when streaming, ``add``/``body`` when not."""

    media_type = "text/event-stream"

    def __init__(self, num_choices: int):
        self._texts: list[list[str]] = [[] for _ in range(num_choices)]
        self._finish: list[str | None] = [None] * num_choices

    def opening(self) -> bytes:
        """What a stream starts with."""
        return b""

    def on_output(self, i: int, out: RequestOutput) -> bytes:
        """Stream pieces for one output of choice i (b"" for none)."""
        raise NotImplementedError

    def closing(self, usage: dict[str, Any]) -> bytes:
        """What a stream ends with."""
        return SSE_DONE

    def error(self, exc: RequestError) -> bytes:
        """How a stream reports a failure after it started."""
        return sse_error(exc)

    def add(self, i: int, out: RequestOutput) -> None:
        """Accumulate one output for a whole (non-streamed) body."""
        self._texts[i].append(out.text)
        if out.finish_reason is not None:
            self._finish[i] = out.finish_reason

    def body(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole JSON body."""
        raise NotImplementedError


class _OpenAIFormat(ResponseFormat):
    """What chat and text completions share: a fixed chunk head, one finish chunk per choice."""

    chunk_object = full_object = ""

    def __init__(self, rid: str, created: int, model: str, num_choices: int, renderer: LogprobRenderer,
                 num_logprobs: int | None, include_usage: bool):
        super().__init__(num_choices)
        self.rid, self.created, self.model = rid, created, model
        self.renderer, self.k, self.include_usage = renderer, num_logprobs, include_usage
        head = _encode({"id": rid, "object": self.chunk_object, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":'
        self._done: set[int] = set()
        self._logprobs: list[list[Any]] = [[] for _ in range(num_choices)]

    def chunk(self, choice: dict[str, Any]) -> bytes:
        """One SSE event carrying one choice."""
        return self._head + _encode([choice]) + b"}\n\n"

    def closing(self, usage: dict[str, Any]) -> bytes:
        tail = self._head + b'[],"usage":' + _encode(usage) + b"}\n\n" if self.include_usage else b""
        return tail + SSE_DONE

    def on_output(self, i: int, out: RequestOutput) -> bytes:
        if i in self._done:  # exactly one finish chunk per choice, whatever the client sends
            return b""
        text, logprobs = self._delta(i, out)
        piece = self.chunk(self._content(i, text, logprobs)) if text or logprobs else b""
        if out.finish_reason is not None:
            self._done.add(i)
            piece += self.chunk(self._finished(i, out.finish_reason))
        return piece

    def add(self, i: int, out: RequestOutput) -> None:
        text, logprobs = self._delta(i, out)
        self._texts[i].append(text)
        if logprobs is not None:
            self._logprobs[i].append(logprobs)
        if out.finish_reason is not None:
            self._finish[i] = out.finish_reason

    def body(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self._whole(i, "".join(t)) for i, t in enumerate(self._texts)]
        return {"id": self.rid, "object": self.full_object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def _delta(self, i: int, out: RequestOutput) -> tuple[str, Any]:
        raise NotImplementedError

    def _content(self, i: int, text: str, logprobs: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _finished(self, i: int, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def _whole(self, i: int, text: str) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(_OpenAIFormat):
    """/v1/chat/completions: a role chunk per choice, content deltas, ``logprobs.content`` lists.

    With ``parsers`` (a factory of one ``ChoiceParser`` per choice: a reasoning and / or a
    tool-call parser), each choice's text is split: streamed as ``delta.reasoning_content``,
    ``delta.content`` and ``delta.tool_calls`` chunks (a call whole in its first fragment, once
    its JSON is complete), whole as the message's ``reasoning_content``, ``content`` and
    ``tool_calls``; a choice that called tools ends with finish_reason ``tool_calls``. A token's
    logprobs ride on the next chunk that choice sends (text held back by a parser sends none).
    """

    chunk_object, full_object = "chat.completion.chunk", "chat.completion"

    def __init__(self, *args: Any, parsers: Callable[[], ChoiceParser] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._parsers = [parsers() for _ in self._texts] if parsers is not None else None
        self._held_logprobs: list[list[Any]] = [[] for _ in self._texts]

    def on_output(self, i: int, out: RequestOutput) -> bytes:
        if self._parsers is None:
            return super().on_output(i, out)
        if i in self._done:
            return b""
        text, logprobs = self._delta(i, out)
        held = self._held_logprobs[i]
        held.extend(logprobs or ())
        final = out.finish_reason is not None
        parser = self._parsers[i]
        parsed = parser.feed(text, final)
        deltas: list[dict[str, Any]] = []
        if parsed.reasoning:
            deltas.append({"reasoning_content": parsed.reasoning})
        if parsed.content:
            deltas.append({"content": parsed.content})
        if parsed.calls:
            deltas.append({"tool_calls": [call.to_openai() for call in parsed.calls]})
        piece = b""
        for delta in deltas:
            piece += self.chunk({"index": i, "delta": delta, "logprobs": self._take_logprobs(held),
                                 "finish_reason": None})
        if final:
            self._done.add(i)
            reason = tool_finish_reason(out.finish_reason, parser.has_calls)
            piece += self.chunk({"index": i, "delta": {}, "logprobs": self._take_logprobs(held),
                                 "finish_reason": reason})
        return piece

    def _take_logprobs(self, held: list[Any]) -> dict[str, Any] | None:
        if self.k is None or not held:
            return None
        taken = list(held)
        held.clear()
        return {"content": taken}

    def opening(self) -> bytes:
        return b"".join(self.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}) for i in range(len(self._texts)))

    def _delta(self, i: int, out: RequestOutput) -> tuple[str, Any]:
        if self.k is None:
            return out.text, None
        return out.text, self.renderer.chat(out.token_ids, out.logprobs, self.k)

    def _content(self, i: int, text: str, logprobs: Any) -> dict[str, Any]:
        return {"index": i, "delta": {"content": text},
                "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": None}

    def _finished(self, i: int, reason: str) -> dict[str, Any]:
        return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}

    def _whole(self, i: int, text: str) -> dict[str, Any]:
        logprobs = None if self.k is None else {"content": [e for part in self._logprobs[i] for e in part]}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = self._finish[i]
        if self._parsers is not None:
            parser = self._parsers[i]
            reasoning, content, calls = parser.whole(text)
            message["content"] = content
            if parser.reasoning:
                message["reasoning_content"] = reasoning
            if parser.tool_calling:
                message["tool_calls"] = [call.to_openai() for call in calls]
                reason = tool_finish_reason(reason, bool(calls))
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}


class CompletionFormat(_OpenAIFormat):
    """/v1/completions: text deltas, legacy logprobs; ``echo`` texts prefix each choice's first delta."""

    chunk_object = full_object = "text_completion"

    def __init__(self, *args: Any, echo: list[str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._echo = list(echo) if echo else None
        self._offsets = [0] * len(self._texts)

    def _delta(self, i: int, out: RequestOutput) -> tuple[str, Any]:
        text = out.text
        if self._echo is not None and self._echo[i] is not None:
            text, self._echo[i] = self._echo[i] + text, None  # type: ignore[call-overload]
            self._offsets[i] = len(text) - len(out.text)  # the prompt gets no logprobs entries
        if self.k is None:
            return text, None
        logprobs = self.renderer.completion(out.token_ids, out.logprobs, self.k, out.text, self._offsets[i])
        self._offsets[i] += len(out.text)
        return text, logprobs

    def _content(self, i: int, text: str, logprobs: Any) -> dict[str, Any]:
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _finished(self, i: int, reason: str) -> dict[str, Any]:
        return {"index": i, "text": "", "logprobs": None, "finish_reason": reason}

    def _whole(self, i: int, text: str) -> dict[str, Any]:
        logprobs = None
        if self.k is not None:
            logprobs = {key: [v for part in self._logprobs[i] for v in part[key]]
                        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": self._finish[i]}


class InteractiveFormat(ResponseFormat):
    """/v1/chat/interactive: LMDeploy's ``{text, tokens, input_tokens, history_tokens, finish_reason}``.

    Streamed as one JSON object per line (``text`` the delta), as LMDeploy's api_client reads it.
    """

    media_type = "application/x-ndjson"

    def __init__(self, session_id: int | None):
        super().__init__(1)
        self.session_id = session_id
        self._last: RequestOutput | None = None

    def _obj(self, text: str, out: RequestOutput | None) -> dict[str, Any]:
        return {"text": text, "tokens": out.completion_tokens if out else 0,
                "input_tokens": out.prompt_tokens if out else 0, "history_tokens": out.history_tokens if out else 0,
                "finish_reason": out.finish_reason if out else None, "session_id": self.session_id}

    def on_output(self, i: int, out: RequestOutput) -> bytes:
        if self._finish[0] is not None:
            return b""
        self._finish[0] = out.finish_reason
        return _encode(self._obj(out.text, out)) + b"\n"

    def closing(self, usage: dict[str, Any]) -> bytes:
        return b""

    def error(self, exc: RequestError) -> bytes:
        return _encode(error_envelope(exc.status, exc.message, exc.type, exc.param, exc.code)) + b"\n"

    def add(self, i: int, out: RequestOutput) -> None:
        super().add(i, out)
        self._last = out

    def body(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = self._obj("".join(self._texts[0]), self._last)
        obj["finish_reason"] = self._finish[0]
        return obj


# ---- reading the events ------------------------------------------------------------------------

async def first_event(events: AsyncIterator[Event]) -> Event | None:
    """The first event, or None for a stream that ends at once."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def collect(events: AsyncIterator[Event], fmt: ResponseFormat) -> None:
    """Feed every event to ``fmt`` for a whole (non-streamed) body."""
    async for i, out in events:
        fmt.add(i, out)


# ---- streaming ---------------------------------------------------------------------------------

async def stream_body(first: Event | None, events: AsyncIterator[Event], fmt: ResponseFormat,
                      usage: Callable[[], dict[str, Any]]) -> AsyncIterator[bytes]:
    """The bytes of a streamed response whose first output (``first``) has already arrived."""
    try:
        piece = fmt.opening()
        if first is not None:
            piece += fmt.on_output(*first)
        if piece:
            yield piece
        if first is not None:
            async for i, out in events:
                piece = fmt.on_output(i, out)
                if piece:
                    yield piece
        yield fmt.closing(usage())
    except RequestError as exc:  # the headers are gone already: report it in the stream
        logger.info("request failed mid-stream: %s", exc.message)
        yield fmt.error(exc)
    except Exception:  # a stream must end with a readable error, not a cut connection
        logger.exception("unexpected error while streaming")
        yield fmt.error(RequestError(500, "internal error while streaming", type="internal_error"))
