"""What users pass in and get back: GenerationConfig and Response (LMDeploy's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from conveyor.engine.errors import InvalidRequestError


@dataclass
class GenerationConfig:
    """Sampling and stopping settings of one request.

    Defaults follow LMDeploy: ``top_k=1`` makes generation greedy until you raise it.
    ``stop_words`` are matched on the generated text (any number of tokens) and are not
    returned; ``bad_words`` are never generated. With ``n > 1`` each prompt gets ``n``
    responses (seeded ``random_seed + i`` when a seed is given).
    """

    n: int = 1
    max_new_tokens: int = 512
    top_p: float = 1.0
    top_k: int = 1
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        rules = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0 (0 means greedy)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 means no limit, 1 greedy)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1 means none)"),
            (self.min_new_tokens is None or self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
        ]
        for ok, name, rule in rules:
            if not ok:
                raise InvalidRequestError(f"GenerationConfig.{name}={getattr(self, name)!r}: {rule}", param=name)
        for name in ("stop_words", "bad_words"):
            words = getattr(self, name)
            if words is not None and (isinstance(words, str) or any(not isinstance(w, str) or not w for w in words)):
                raise InvalidRequestError(f"GenerationConfig.{name} must be a list of non-empty strings", param=name)


@dataclass
class Response:
    """One prompt's result, or (from ``stream_infer``) one increment of it.

    In a stream, ``text`` and ``token_ids`` are the new part and ``generate_token_len`` is
    the running total. ``logprobs`` has one ``{token_id: logprob}`` dict per generated token
    (the top-N plus the chosen one). ``num_cached_tokens`` counts prompt tokens whose KV was
    reused from the prefix cache.
    """

    text: str
    generate_token_len: int
    input_token_len: int
    session_id: int
    finish_reason: Literal["stop", "length", "abort"] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    num_cached_tokens: int = 0
