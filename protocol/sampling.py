"""One request's sampling parameters: the struct the pipeline, the wire and the engine share.

The field names are LMDeploy's ``GenerationConfig`` names (``stop_words``, ``random_seed``,
``include_stop_str_in_output``, ...). Words travel as text; the tokenizer stage adds the
model's end-of-sequence ids to ``stop_token_ids`` and turns ``bad_words`` into
``bad_token_ids`` (one-token words) and ``bad_sequences`` (longer ones) before the engine sees
the request. ``stop_words`` are matched on text by the detokenizer, never by the engine; the
detokenizer gets only the fields it applies (``DetokenizeParams``, in ``Admitted``).

The struct's defaults are LMDeploy's ``GenerationConfig`` defaults (the pipeline's). LMDeploy's
api_server has defaults of its own per route; they are written once too, below the struct
(``OPENAI_DEFAULTS``, ``INTERACTIVE_DEFAULTS``), for the request bodies and clients to read.

``validate`` is the one check every entry runs: ``GenerationConfig`` (the pipeline), the
OpenAI bodies (the ingress), the tokenizer stage and the engine's ``add_request``. It covers
every field the engine indexes or computes with, because a peer stage can send any value the
wire types allow (NaN, infinities, ids outside the vocabulary, 64-bit counts): a value that
passes never raises in the sampler or the scheduler.
"""

from __future__ import annotations

import msgspec

from .errors import InvalidRequestError
from .guided import Guide, check_guide

MAX_LOGPROBS = 20  # alternatives per token the engine reports (OpenAI's top_logprobs limit)
MIN_PENALTY, MAX_PENALTY = 0.01, 100.0
# The sampler divides float32 logits by the temperature: below 1e-8 they overflow to inf (and
# softmax to NaN), past 1e6 every token is equally likely anyway.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-8, 1e6
# top_k goes into the sampler's int64 tensor, where 2**64 - 1 overflows; past the vocabulary it
# means no limit, so int32 (the ingress's bound on ids and counts) loses nothing.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1  # counts the wire carries must also fit the engine's int64 tensors
MAX_ADAPTER_NAME = 256  # characters of a LoRA adapter's name
SEED_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries; the engine reduces a seed mod 2**63


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How to sample one request and when to stop it.

    ``top_k <= 0`` means no top-k limit; ``top_k == 1`` or ``temperature == 0`` is greedy.
    """

    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 0.8
    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] = []
    bad_words: list[str] = []
    stop_token_ids: list[int] = []
    bad_token_ids: list[int] = []
    # Multi-token bad words as ids, filled by the tokenizer stage from ``bad_words``: the last
    # token is banned when the ones before it were just generated.
    bad_sequences: list[list[int]] = []
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What the output must match (a JSON schema, a regex, ...): the engine masks every token that
    # would leave it (``protocol/guided.py``).
    guide: Guide | None = None
    # The LoRA adapter (by its registered name) the model runs this request with; None: the base
    # model alone (``engine/lora/``). LMDeploy's ``adapter_name``.
    adapter_name: str | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def detokenize_params(self) -> DetokenizeParams:
        """The part of these parameters the detokenizer applies."""
        return DetokenizeParams(self.stop_words, self.skip_special_tokens, self.include_stop_str_in_output)


class DetokenizeParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How a request's text is rendered and where it stops: what the detokenizer needs of its
    ``SamplingParams`` (no defaults here: it is always made by ``SamplingParams.detokenize_params``)."""

    stop_words: list[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool


# LMDeploy's api_server samples with defaults that differ from GenerationConfig's (the struct's
# own, above): its OpenAI routes (/v1/chat/completions, /v1/completions) at temperature 0.7 and
# top_k 40, its /v1/chat/interactive (``GenerateRequest``) at top_p 0.8 and top_k 40, with
# request_output_len 512. Every other field keeps the struct's default. Read them, never change
# them: the HTTP bodies, their documentation, the web chat and the clients share these objects.
OPENAI_DEFAULTS = SamplingParams(temperature=0.7, top_k=40)
INTERACTIVE_DEFAULTS = SamplingParams(top_p=0.8, top_k=40)

# Stop strings are matched on the text: an empty one would match everywhere.
_STOP_WORDS_RULE = ("stop_words", lambda p: all(isinstance(w, str) and w for w in p.stop_words),
                    "must be a list of non-empty strings")
_RULES = (
    ("max_new_tokens", lambda p: 1 <= p.max_new_tokens <= INT64_MAX, f"must be in [1, {INT64_MAX}]"),
    ("min_new_tokens", lambda p: 0 <= p.min_new_tokens <= INT64_MAX, f"must be in [0, {INT64_MAX}]"),
    # Written as ranges, so that NaN (which compares false to everything) fails them too.
    ("temperature", lambda p: p.temperature == 0 or MIN_TEMPERATURE <= p.temperature <= MAX_TEMPERATURE,
     f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"),
    ("top_p", lambda p: 0 < p.top_p <= 1, "must be in (0, 1]"),
    ("top_k", lambda p: 0 <= p.top_k <= INT32_MAX, f"must be in [0, {INT32_MAX}] (0 means no limit, 1 greedy)"),
    ("min_p", lambda p: 0 <= p.min_p <= 1, "must be in [0, 1]"),
    # Bounded both ways: the penalty divides or multiplies logits, and 1e-300 would make them inf.
    ("repetition_penalty", lambda p: MIN_PENALTY <= p.repetition_penalty <= MAX_PENALTY,
     f"must be in [{MIN_PENALTY}, {MAX_PENALTY:g}] (1 means none)"),
    ("logprobs", lambda p: p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
     f"must be in [0, {MAX_LOGPROBS}]"),
    _STOP_WORDS_RULE,
    ("bad_words", lambda p: all(isinstance(w, str) and w for w in p.bad_words),
     "must be a list of non-empty strings"),
    ("stop_token_ids", lambda p: all(t >= 0 for t in p.stop_token_ids), "token ids must be >= 0"),
    ("bad_token_ids", lambda p: all(t >= 0 for t in p.bad_token_ids), "token ids must be >= 0"),
    # The sampler bans an entry's last token after the ones before it: an entry needs both.
    ("bad_sequences", lambda p: all(len(s) >= 2 for s in p.bad_sequences),
     "each entry needs at least 2 token ids (ban a single token with bad_token_ids)"),
    ("bad_sequences", lambda p: all(t >= 0 for s in p.bad_sequences for t in s), "token ids must be >= 0"),
    ("random_seed", lambda p: p.random_seed is None or SEED_RANGE[0] <= p.random_seed <= SEED_RANGE[1],
     f"must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (64 bits)"),
    ("adapter_name", lambda p: p.adapter_name is None or (isinstance(p.adapter_name, str)
                                                         and 0 < len(p.adapter_name) <= MAX_ADAPTER_NAME),
     f"must be null (the base model) or the name of a loaded LoRA adapter (1 to {MAX_ADAPTER_NAME} characters)"),
    # A finished grammar allows only the end tokens: without them it could never end.
    ("ignore_eos", lambda p: not (p.ignore_eos and p.guide is not None),
     "cannot be combined with a response format (a completed output ends on the end token)"),
)
_DETOKENIZE_RULES = (_STOP_WORDS_RULE,)


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a refused list may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def validate(params: SamplingParams, vocab_size: int | None = None, prefix: str = "") -> SamplingParams:
    """Raise InvalidRequestError naming the first bad field and its valid range; return ``params``.

    With ``vocab_size``, token ids must also lie in the vocabulary. ``prefix`` goes before the
    field name in the message (``"GenerationConfig."`` for the pipeline).
    """
    _check(params, _RULES, prefix)
    if params.guide is not None:
        check_guide(params.guide, f"{prefix}guide" if prefix else "response_format")
    if vocab_size is not None:
        lists = {"stop_token_ids": params.stop_token_ids, "bad_token_ids": params.bad_token_ids,
                 "bad_sequences": [t for s in params.bad_sequences for t in s]}
        for name, ids in lists.items():
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{prefix}{name}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=name)
    return params


def validate_detokenize(params: DetokenizeParams) -> DetokenizeParams:
    """``validate`` for the detokenizer's part of a request's parameters."""
    _check(params, _DETOKENIZE_RULES)
    return params


def _check(params: SamplingParams | DetokenizeParams, rules: tuple, prefix: str = "") -> None:
    """Raise InvalidRequestError for the first of ``rules`` that ``params`` breaks."""
    for name, ok, rule in rules:
        if not ok(params):
            raise InvalidRequestError(f"{prefix}{name}={_shown(getattr(params, name))}: {rule}", param=name)
