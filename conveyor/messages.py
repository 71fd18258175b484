"""What users pass in and get back: GenerationConfig and Response (LMDeploy's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from conveyor.protocol.errors import InvalidRequestError
from conveyor.protocol.guided import guide_from_response_format
from conveyor.protocol.sampling import SamplingParams, validate


class GenerationConfig(SamplingParams, kw_only=True):
    """Sampling and stopping settings of one request: the engine's ``SamplingParams`` (LMDeploy's
    field names and defaults) plus ``n``, checked when made.

    Defaults follow LMDeploy: ``top_k=1`` makes generation greedy until you raise it.
    ``stop_words`` are matched on the generated text (any number of tokens) and are not
    returned; ``bad_words`` are never generated. With ``n > 1`` each prompt gets ``n``
    responses (seeded ``random_seed + i`` when a seed is given). ``None`` is accepted wherever
    LMDeploy's default is ``None`` (the word and id lists, ``min_new_tokens``).

    ``response_format`` (LMDeploy's) constrains the output: ``dict(type='json_schema',
    json_schema=dict(name=..., schema={...}))``, ``dict(type='json_object')`` or
    ``dict(type='regex_schema', regex_schema='...')``; it sets ``guide``, which ``sampling_params``
    carries to the engine.
    """

    n: int = 1
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise InvalidRequestError(f"GenerationConfig.n={self.n!r}: must be >= 1", param="n")
        if self.response_format is not None:
            guide = guide_from_response_format(self.response_format, "GenerationConfig.response_format")
            if self.guide is not None and guide != self.guide:
                raise InvalidRequestError("GenerationConfig: response_format and guide say different things; give "
                                          "one", param="response_format")
            self.guide = guide
        for name in ("stop_words", "bad_words", "stop_token_ids", "bad_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise InvalidRequestError(f"GenerationConfig.{name} must be a list, not a string", param=name)
            setattr(self, name, list(value or []))
        self.min_new_tokens = self.min_new_tokens or 0
        validate(self, prefix="GenerationConfig.")

    def sampling_params(self, sample: int = 0) -> SamplingParams:
        """The engine's parameters for response ``sample`` of a prompt (seeded ``random_seed + sample``)."""
        fields = {name: getattr(self, name) for name in SamplingParams.__struct_fields__}
        if self.random_seed is not None:
            fields["random_seed"] = self.random_seed + sample
        return SamplingParams(**fields)


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

    def __repr__(self) -> str:
        # print(pipe(prompts)) shows the texts and counts; the id and logprob lists (hundreds of
        # numbers each) are summarised by their length.
        logprobs = "None" if self.logprobs is None else f"<{len(self.logprobs)} tokens>"
        return (f"Response(text={self.text!r}, generate_token_len={self.generate_token_len}, "
                f"input_token_len={self.input_token_len}, finish_reason={self.finish_reason!r}, "
                f"session_id={self.session_id}, index={self.index}, token_ids=<{len(self.token_ids)} ids>, "
                f"logprobs={logprobs}, num_cached_tokens={self.num_cached_tokens})")
