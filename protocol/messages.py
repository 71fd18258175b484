"""Every message that crosses a process boundary, as msgspec Structs. Nothing else is sent.

Sockets and what they carry (see addresses.py for where each is bound):
  ingress      -> tokenizer    GenerateReq, Ping
  tokenizer    -> engine       TokenizedReq, Ping
  ingress      -> engine       Abort, SessionEnd, CancelSession, Ping (heartbeat),
                               LoadAdapter, UnloadAdapter (LoRA adapters at run time)
  launcher     -> engine       IngressGone
  detokenizer  -> engine       StopReq
  engine       -> detokenizer  Admitted, TokenBatch, ErrorOut (refusals), LoadReport, AdapterDone
  detokenizer  -> ingress      Admitted, TextBatch, ErrorOut, LoadReport, AdapterDone
  tokenizer    -> ingress      ErrorOut
  any stage    -> launcher     Ready
  launcher     -> ingress      StageStatus
Each socket's messages form one tagged union, decoded by one reused Decoder.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Union

import msgspec

from .sampling import DetokenizeParams, SamplingParams
from .multimodal import ImageInput

_WIRE = {"array_like": True, "omit_defaults": True, "gc": False}
# Messages of a union carry a small int tag as their first array element.
_TAG = {**_WIRE, "tag_field": "_t"}


class Stage(IntEnum):
    """The kinds of process."""

    INGRESS = 0
    TOKENIZER = 1
    ENGINE = 2
    DETOKENIZER = 3


class Finish(IntEnum):
    """Why a request ended: the one finish enum of the engine, the wire and the ingress."""

    STOP = 0  # a stop token or stop string
    LENGTH = 1  # max_new_tokens, session_len, or more KV than the cache holds
    ABORT = 2  # the client went away or cancelled
    ERROR = 3  # a stage failed

    @property
    def openai(self) -> str:
        """finish_reason as the OpenAI API spells it."""
        return FINISH_REASONS[self]


FINISH_REASONS = ("stop", "length", "abort", "error")


class GenerateReq(msgspec.Struct, tag=1, **_TAG):
    """A new request from an ingress. Exactly one of prompt / messages / input_ids is set.

    ``sequence_start``: whether this is a conversation's first turn (chat template with the
    system prompt and BOS). ``None`` (a session turn whose history only the engine knows) has
    the tokenizer render it both ways and the engine pick.
    """

    rid: str
    reply_to: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    do_preprocess: bool = True
    session_id: int | None = None
    sequence_start: bool | None = True
    priority: int = 0  # the engine admits waiting requests with a lower value first (QoS user groups)
    # The chat template's options (for ``messages``, or a prompt with ``do_preprocess``): a Jinja
    # template's extra variables (Qwen3's enable_thinking), whether the prompt ends where the
    # assistant speaks, or inside the last (assistant) message, which the model continues.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's function tools (``[{"type": "function", "function": {...}}]``), which the chat
    # template renders into the prompt (transformers' ``apply_chat_template(..., tools=...)``).
    tools: list[dict[str, Any]] | None = None


class TokenizedReq(msgspec.Struct, tag=2, **_TAG):
    """A request ready for the engine: token ids, and parameters with every word resolved.

    ``first_turn_ids``: the prompt rendered as a conversation's first turn, sent when the
    ingress left ``sequence_start`` to the engine; the engine uses it when the session is new.
    """

    rid: str
    reply_to: str
    token_ids: list[int]
    params: SamplingParams
    session_id: int | None = None
    first_turn_ids: list[int] | None = None
    priority: int = 0  # GenerateReq's, passed on
    # The prompt's images, preprocessed, each with the span of ``token_ids`` it fills; with
    # ``first_turn_ids`` the engine shifts the spans by the two renderings' length difference
    # (they differ only before the turn's own text).
    images: list[ImageInput] = []


class Abort(msgspec.Struct, tag=3, **_TAG):
    """Stop a request now (its client went away)."""

    rid: str


class SessionEnd(msgspec.Struct, tag=4, **_TAG):
    """Free a session's KV blocks and forget its history (its running turn, if any, is aborted)."""

    session_id: int


class CancelSession(msgspec.Struct, tag=5, **_TAG):
    """Abort a session's running turn; the session and its history stay."""

    session_id: int


class StopReq(msgspec.Struct, tag=6, **_TAG):
    """The detokenizer found a stop string: the engine ends the request."""

    rid: str


class Ping(msgspec.Struct, tag=7, **_TAG):
    """Travels the ring ingress -> tokenizer -> engine -> detokenizer -> ingress; proves it works.

    An ingress also sends it straight to the engine: that is its heartbeat. The engine aborts the
    requests of a ``reply_to`` it stops hearing from (their client is gone), and the ingress
    knows the engine answers even while no tokenizer worker is up.
    """

    reply_to: str
    sent_at: float
    stage_stats: dict[str, float] = {}


class EngineStats(msgspec.Struct, **_WIRE):
    """The engine's queues, cache and counters (``LLMEngine.stats()``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    free_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    generated_tokens: int = 0  # since the engine started
    adapters: list[str] = []  # the LoRA adapters loaded, by name (every ingress learns them from here)


class LoadReport(msgspec.Struct, tag=8, **_TAG):
    """The engine's state, answering a Ping (it comes back to the ingress that sent it)."""

    reply_to: str
    sent_at: float
    engine: EngineStats = msgspec.field(default_factory=EngineStats)
    draining: bool = False
    # Counters each stage adds as the report passes through it (busy seconds, items handled).
    stage_stats: dict[str, float] = {}


class Admitted(msgspec.Struct, tag=9, **_TAG):
    """The engine took a request. It reaches the detokenizer before any of the request's
    tokens (the detokenizer starts its state here) and is forwarded to the ingress.

    ``num_prompt_tokens``: this turn's prompt; ``history_tokens``: a session's tokens before it.
    ``detokenize``: the part of the request's SamplingParams the detokenizer applies (the
    ingress reads only the rid and ``history_tokens``).
    """

    rid: str
    reply_to: str
    num_prompt_tokens: int
    detokenize: DetokenizeParams
    prompt_tail: list[int] = []  # the last prompt tokens: context for decoding the first output
    history_tokens: int = 0


class TokenBatch(msgspec.Struct, tag=10, **_TAG):
    """One engine step's output, column-wise: entry i is about request rids[i]."""

    rids: list[str]
    tokens: list[int]  # -1: no new token this time (e.g. finished by an abort)
    finish: list[int]  # -1 while running, else a Finish value
    cached: list[int]  # prompt tokens served by the prefix cache
    logprobs: list[float] | None = None  # chosen token's logprob, where asked
    top_logprobs: list[list[tuple[int, float]]] | None = None


class TextBatch(msgspec.Struct, tag=11, **_TAG):
    """Text increments for one ingress, column-wise."""

    rids: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    finish: list[int]  # -1 while running, else a Finish value
    prompt_tokens: list[int]
    completion_tokens: list[int]  # running totals
    cached: list[int]
    logprobs: list[list[dict[int, float]] | None] | None = None


class ErrorOut(msgspec.Struct, tag=12, **_TAG):
    """A request was refused or failed; rendered by the ingress as an OpenAI error envelope.

    ``code`` is OpenAI's machine-readable code where one applies (e.g. context_length_exceeded).
    """

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    reply_to: str = ""  # where to deliver it, when the sender is not the ingress's direct peer


class Ready(msgspec.Struct, tag=13, **_TAG):
    """A stage finished starting and accepts traffic (the launcher waits for every one).

    ``token``: the deployment's launcher token (``Addresses.launcher_token``); the launcher takes
    a Ready only from a process it started that knows it.
    """

    stage: Stage
    pid: int
    info: dict[str, Any] = {}
    token: str = ""


class StageStatus(msgspec.Struct, tag=14, **_TAG):
    """The launcher saw a stage process stop or become ready again (sent to the ingress)."""

    name: str  # "engine", "detokenizer", "tokenizer-0", ...
    up: bool
    pid: int
    restarts: int = 0
    token: str = ""  # the launcher token: the ingress ignores a notice without it
    stats: dict[str, float] = {}  # the launcher's own counters (name "launcher"): bad frames, refused READYs
    peers: int = 1  # processes of this stage's kind the launcher runs (tokenizer workers: N)


class IngressGone(msgspec.Struct, tag=15, **_TAG):
    """The launcher saw the ingress at ``reply_to`` die: the engine aborts every request it sent."""

    reply_to: str
    token: str = ""  # the launcher token: the engine ignores a notice without it


class LoadAdapter(msgspec.Struct, tag=16, **_TAG):
    """Load the PEFT LoRA checkpoint at ``path`` (a directory the engine's host reads) as ``name``.

    The engine answers ``reply_to`` (through the detokenizer, as every answer) with AdapterDone,
    or ErrorOut: 400 for a bad checkpoint, a name taken or an engine without LoRA.
    """

    rid: str
    reply_to: str
    name: str
    path: str


class UnloadAdapter(msgspec.Struct, tag=17, **_TAG):
    """Forget the LoRA adapter ``name`` (its running requests finish with it); answered as LoadAdapter
    is (ErrorOut 404 model_not_found for a name not loaded)."""

    rid: str
    reply_to: str
    name: str


class AdapterDone(msgspec.Struct, tag=18, **_TAG):
    """A LoadAdapter / UnloadAdapter was applied; ``adapters``: every adapter loaded now, in load order."""

    rid: str
    reply_to: str
    adapters: list[str] = []


# One union per receiving socket.
TokenizerIn = Union[GenerateReq, Ping]
EngineIn = Union[TokenizedReq, Abort, SessionEnd, CancelSession, StopReq, Ping, IngressGone, LoadAdapter,
                 UnloadAdapter]
DetokenizerIn = Union[Admitted, TokenBatch, ErrorOut, LoadReport, AdapterDone]
IngressIn = Union[Admitted, TextBatch, ErrorOut, LoadReport, StageStatus, AdapterDone]
LauncherIn = Ready
