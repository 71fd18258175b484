"""What a receiving stage checks of a decoded message before it uses it.

A typed Decoder guarantees each field's type, not its value: a peer on the stage sockets can
send ragged columns, unknown finish values, ids no vocabulary has, or 64-bit numbers. A request
whose field fails is refused with ``InvalidRequestError`` (a 400 naming the field, sent to its
``reply_to``); any other message is dropped whole, before any of it is applied, with
``MalformedMessageError``, which the stage counts and logs. ``SamplingParams`` has its own
checks (``sampling.validate``).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import ConveyorError, InvalidRequestError
from .messages import Admitted, ErrorOut, Finish, TextBatch, TokenBatch
from .sampling import INT32_MAX, INT64_MAX, MAX_LOGPROBS, validate_detokenize

INT64_MIN = -(2**63)
# No vocabulary is this large (the ingress's own schema takes ids as int32): a token id past it
# cannot be the engine's, and a tokenizer's decode raises on ids past 2**32.
TOKEN_ID_LIMIT = INT32_MAX + 1
_FINISH_VALUES = frozenset(int(f) for f in Finish)


class MalformedMessageError(ConveyorError, ValueError):
    """A message that is not a request broke the protocol's rules: the stage drops it whole."""


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Refuse (``InvalidRequestError`` naming ``param``) an id outside ``[0, vocab_size)``."""
    # min/max run at C speed on a long prompt; only a refusal looks for the id to name.
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})",
                                  param=param)


def check_int64(value: int | None, param: str) -> None:
    """Refuse a value that does not fit a signed 64-bit integer (the wire carries up to 2**64 - 1)."""
    if value is not None and not INT64_MIN <= value <= INT64_MAX:
        raise InvalidRequestError(f"{param}={value}: must be in [{INT64_MIN}, {INT64_MAX}]", param=param)


def _same_length(kind: str, n: int, columns: dict[str, list | None]) -> None:
    for name, column in columns.items():
        if column is not None and len(column) != n:
            raise MalformedMessageError(f"{kind}.{name} has {len(column)} entries for {n} rids")


def _finish_values(kind: str, finish: list[int]) -> None:
    bad = next((f for f in finish if f != -1 and f not in _FINISH_VALUES), None)
    if bad is not None:
        raise MalformedMessageError(f"{kind}.finish holds {bad}: not -1 nor a Finish value")


def _counts(kind: str, name: str, values: Iterable[int]) -> None:
    bad = next((v for v in values if not 0 <= v <= INT64_MAX), None)
    if bad is not None:
        raise MalformedMessageError(f"{kind}.{name} holds {bad}: a count must be in [0, {INT64_MAX}]")


def _wire_ids(kind: str, name: str, ids: Iterable[int]) -> None:
    bad = next((t for t in ids if not 0 <= t < TOKEN_ID_LIMIT), None)
    if bad is not None:
        raise MalformedMessageError(f"{kind}.{name} holds token id {bad}, outside [0, {TOKEN_ID_LIMIT})")


def check_token_batch(batch: TokenBatch) -> None:
    """Raise MalformedMessageError unless ``batch`` is one whole engine step: every column has an
    entry per rid, tokens are ids or -1, finishes are -1 or Finish values, counts are counts."""
    n = len(batch.rids)
    _same_length("TokenBatch", n, {"tokens": batch.tokens, "finish": batch.finish, "cached": batch.cached,
                                   "logprobs": batch.logprobs, "top_logprobs": batch.top_logprobs})
    _wire_ids("TokenBatch", "tokens", (t for t in batch.tokens if t != -1))
    _finish_values("TokenBatch", batch.finish)
    _counts("TokenBatch", "cached", batch.cached)
    if batch.top_logprobs is not None:
        if any(len(top) > MAX_LOGPROBS for top in batch.top_logprobs):
            raise MalformedMessageError(f"TokenBatch.top_logprobs has an entry of more than {MAX_LOGPROBS} "
                                        "alternatives")
        _wire_ids("TokenBatch", "top_logprobs", (t for top in batch.top_logprobs for t, _ in top))


def check_admitted(msg: Admitted) -> None:
    """Raise MalformedMessageError unless ``msg``'s counts, prompt tail and parameters are valid."""
    _counts("Admitted", "num_prompt_tokens", (msg.num_prompt_tokens, msg.history_tokens))
    _wire_ids("Admitted", "prompt_tail", msg.prompt_tail)
    try:
        validate_detokenize(msg.detokenize)
    except InvalidRequestError as exc:
        raise MalformedMessageError(f"Admitted.detokenize: {exc}") from exc


def check_error_out(msg: ErrorOut) -> None:
    """Raise MalformedMessageError unless ``msg.status`` is an HTTP error status (the ingress
    answers with it)."""
    if not 400 <= msg.status <= 599:
        raise MalformedMessageError(f"ErrorOut.status={msg.status}: not an HTTP error status (400-599)")


def check_text_batch(batch: TextBatch) -> None:
    """Raise MalformedMessageError unless every column of ``batch`` has an entry per rid, its
    finishes are -1 or Finish values and its counts are counts (for the ingress's reader)."""
    n = len(batch.rids)
    _same_length("TextBatch", n, {"texts": batch.texts, "token_ids": batch.token_ids, "finish": batch.finish,
                                  "prompt_tokens": batch.prompt_tokens,
                                  "completion_tokens": batch.completion_tokens, "cached": batch.cached,
                                  "logprobs": batch.logprobs})
    _finish_values("TextBatch", batch.finish)
    for name in ("prompt_tokens", "completion_tokens", "cached"):
        _counts("TextBatch", name, getattr(batch, name))
