"""Every message that crosses a process boundary, as msgspec Structs. Nothing else is sent.

Sockets and what they carry (see addresses.py for where each is bound):
  ingress      -> tokenizer    GenerateReq, Ping
  tokenizer    -> engine       TokenizedReq, Ping
  ingress      -> engine       Abort, SessionEnd
  detokenizer  -> engine       StopReq
  engine       -> detokenizer  TokenBatch, LoadReport
  detokenizer  -> ingress      TextBatch, LoadReport
  tokenizer    -> ingress      ErrorOut (engine errors travel inside TokenBatch)
  any stage    -> launcher     Ready
Each socket's messages form one tagged union, decoded by one reused Decoder.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Union

import msgspec

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
    """Why a request ended (engine FinishReason values, plus ERROR for failures)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    @property
    def openai(self) -> str:
        """finish_reason as the OpenAI API spells it."""
        return ("stop", "length", "abort", "error")[self]


class SamplingOptions(msgspec.Struct, **_WIRE):
    """Generation settings as the user gave them (words still text; the tokenizer resolves them)."""

    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 0.8
    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] = []
    bad_words: list[str] = []
    stop_token_ids: list[int] = []
    bad_token_ids: list[int] = []
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str: bool = False


class GenerateReq(msgspec.Struct, tag=1, **_TAG):
    """A new request from an ingress. Exactly one of prompt / messages / input_ids is set."""

    rid: str
    reply_to: str
    options: SamplingOptions
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    do_preprocess: bool = True
    session_id: int | None = None
    sequence_start: bool = True


class EngineParams(msgspec.Struct, **_WIRE):
    """Sampling parameters with every word resolved to token ids (engine SamplingParams' fields)."""

    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 0.8
    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_token_ids: list[int] = []
    bad_token_ids: list[int] = []
    bad_sequences: list[list[int]] = []
    logprobs: int | None = None


class DetokSpec(msgspec.Struct, **_WIRE):
    """What the detokenizer needs to turn a request's tokens into text."""

    reply_to: str
    prompt_tail: list[int] = []
    stop: list[str] = []
    skip_special_tokens: bool = True
    include_stop_str: bool = False


class TokenizedReq(msgspec.Struct, tag=2, **_TAG):
    """A request ready for the engine."""

    rid: str
    token_ids: list[int]
    params: EngineParams
    detok: DetokSpec
    session_id: int | None = None


class Abort(msgspec.Struct, tag=3, **_TAG):
    """Stop a request now (its client went away)."""

    rid: str


class SessionEnd(msgspec.Struct, tag=4, **_TAG):
    """Free a session's KV blocks and forget its history."""

    session_id: int


class StopReq(msgspec.Struct, tag=5, **_TAG):
    """The detokenizer found a stop string: the engine ends the request."""

    rid: str


class Ping(msgspec.Struct, tag=6, **_TAG):
    """Travels the ring ingress -> tokenizer -> engine -> detokenizer -> ingress; proves it works."""

    reply_to: str
    sent_at: float
    stage_stats: dict[str, float] = {}


class LoadReport(msgspec.Struct, tag=7, **_TAG):
    """The engine's state, answering a Ping (it comes back to the ingress that sent it)."""

    reply_to: str
    sent_at: float
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    free_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    generated_tokens: int = 0  # since the engine started
    draining: bool = False
    # Counters each stage adds as the report passes through it (busy seconds, items handled).
    stage_stats: dict[str, float] = {}


class NewRequest(msgspec.Struct, **_WIRE):
    """Announces a request to the detokenizer, before its first token."""

    rid: str
    detok: DetokSpec
    num_prompt_tokens: int


class TokenBatch(msgspec.Struct, tag=8, **_TAG):
    """One engine step's output, column-wise: entry i is about request rids[i]."""

    rids: list[str]
    tokens: list[int]  # -1: no new token this time (e.g. finished by an abort)
    finish: list[int]  # -1 while running, else a Finish value
    cached: list[int]  # prompt tokens served by the prefix cache
    new: list[NewRequest] = []  # requests admitted since the last batch (come first)
    logprobs: list[float] | None = None  # chosen token's logprob, where asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    errors: list["ErrorOut"] = []  # requests the engine refused


class TextBatch(msgspec.Struct, tag=9, **_TAG):
    """Text increments for one ingress, column-wise."""

    rids: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    finish: list[int]  # -1 while running, else a Finish value
    prompt_tokens: list[int]
    completion_tokens: list[int]  # running totals
    cached: list[int]
    logprobs: list[list[dict[int, float]] | None] | None = None


class ErrorOut(msgspec.Struct, tag=10, **_TAG):
    """A request failed; rendered by the ingress as an OpenAI error envelope.

    ``code`` is OpenAI's machine-readable code where one applies (e.g. context_length_exceeded).
    """

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    reply_to: str = ""  # where to deliver it, when the sender is not the ingress's direct peer


class Ready(msgspec.Struct, tag=11, **_TAG):
    """A stage finished starting and accepts traffic (the launcher waits for every one)."""

    stage: Stage
    pid: int
    info: dict[str, Any] = {}


# One union per receiving socket.
TokenizerIn = Union[GenerateReq, Ping]
EngineIn = Union[TokenizedReq, Abort, SessionEnd, StopReq, Ping]
DetokenizerIn = Union[TokenBatch, LoadReport]
IngressIn = Union[TextBatch, ErrorOut, LoadReport]
LauncherIn = Ready
