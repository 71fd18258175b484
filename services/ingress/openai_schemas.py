"""Request and response bodies of the HTTP ingress: OpenAI's API plus LMDeploy's /v1/chat/interactive.

Requests check types and the API's own limits here (``n``, ``top_logprobs``, ``seed``, ...);
each body maps onto the engine's one ``SamplingParams`` (``sampling_params``), which
``protocol.sampling.validate`` checks like every other entry, so the ingress answers 400 before
anything reaches the engine. Prompt lengths, the chat template and a constraint's syntax are
checked by the tokenizer stage.

No field is dropped without a word. The fields conveyor knows act: OpenAI's (``tools`` /
``tool_choice`` included: ``tool_calling.py``), LMDeploy's, and vLLM's / SGLang's extensions
(constrained output through ``response_format``, ``guided_*``, ``structured_outputs``, ``regex`` /
``ebnf`` / ``json_schema``, one per request, as a ``protocol.guided.Guide``;
``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``, ``min_tokens``,
``bad_words``, ``no_stop_trim``). Known fields the engine cannot honour are refused with a 400
naming the alternative, unless they hold their no-op value: ``presence_penalty`` /
``frequency_penalty`` other than 0 (the engine implements ``repetition_penalty``),
``logit_bias``, OpenAI's older ``functions`` / ``function_call`` (send ``tools`` /
``tool_choice``), beam search, ``best_of`` above ``n``, prompt logprobs, ``priority`` (QoS sets
it), per-request chat templates, multimodal and disaggregation fields (``_REFUSED``; SGLang's
per-request ``lora_path`` too: an adapter is loaded once, then named in ``model`` as vLLM does,
or in LMDeploy's ``adapter_name``, which every generation body takes). Unknown
fields are ignored (OpenAI clients send some conveyor has no use for, e.g. ``store``,
``metadata``) and logged once per name. LMDeploy's bodies are taken as they are written:
``"stop": false`` means no stop strings, ``session_id: -1`` a request of no session, ``top_k: -1``
(as vLLM's clients send it) no top-k limit. Sampling defaults are LMDeploy's api_server's
(``protocol.sampling.OPENAI_DEFAULTS`` and ``INTERACTIVE_DEFAULTS``), not OpenAI's.

The response models describe the whole bodies in /docs and /openapi.json; streamed chunks are
written as bytes by ``sse.py``, which matches OpenAI's chunk shapes field for field.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field,
                      ModelWrapValidatorHandler, PrivateAttr, Tag, model_validator)

from ...protocol import FINISH_REASONS, InvalidRequestError, SamplingParams, validate
from ...protocol.guided import Guide, guide_from_fields, guide_from_response_format
from ...protocol.sampling import INTERACTIVE_DEFAULTS, OPENAI_DEFAULTS
from ..tokenizer.chat_template import check_template_kwargs

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
MAX_N = 128  # choices per request: each is a separate engine request
MAX_TOP_LOGPROBS = 20  # chat completions (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # legacy completions (OpenAI's limit)
MAX_SEED = 2**53 - 1  # exact as a JSON number (a double), so every client parses it alike


def _integral(value: Any) -> Any:
    # JSON Schema counts 2.0 as an integer; strict mode would refuse it, so turn it into 2 first.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def int_in(ge: int, le: int) -> Any:
    """An integer field type in [ge, le] (bounds kept in the core schema so /openapi.json shows them)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


def _unicode_text(value: str) -> str:
    # JSON can carry a lone UTF-16 surrogate ("\ud800"); it has no UTF-8 form, so no stage could
    # tokenize it or send it on: refuse it here, naming the field.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate ({value[exc.start]!r} at character {exc.start}): "
                         "send valid Unicode") from None
    return value


# Constraints live in the types (not in validators) so that /openapi.json states every rule.
_T = TypeVar("_T")
NonEmpty = Annotated[_T, Field(min_length=1)]
Text = Annotated[str, AfterValidator(_unicode_text)]  # text that reaches the tokenizer or detokenizer
NonEmptyStr = Annotated[Text, Field(min_length=1)]
Stop = NonEmptyStr | list[NonEmptyStr]  # stop strings: an empty one would match everywhere


def _false_is_none(value: Any) -> Any:
    # LMDeploy's documented bodies send "stop": false for "no stop strings".
    return None if value is False else value


def _no_limit_is_zero(value: int) -> int:
    # vLLM's clients send top_k -1 for "no limit"; the engine's "no limit" is 0.
    return 0 if value == -1 else value


StopOrFalse = Annotated[Stop | None, BeforeValidator(_false_is_none)]
TopK = Annotated[int, AfterValidator(_no_limit_is_zero)]
TokenId = int_in(0, INT32_MAX)


# Unknown field names already logged (each once); bounded, since every request may bring new ones.
_LOGGED_UNKNOWN: set[str] = set()
MAX_LOGGED_UNKNOWN = 256


def _log_unknown(where: str, name: str) -> None:
    key = f"{where}.{name}"
    if key in _LOGGED_UNKNOWN or len(_LOGGED_UNKNOWN) >= MAX_LOGGED_UNKNOWN:
        return
    _LOGGED_UNKNOWN.add(key)
    logger.warning("ignored field %r of %s: conveyor has no use for it (logged once per name)", name[:100], where)


class _Body(BaseModel):
    """Base of every request body: extra fields ignored (and logged once per name), NaN / Infinity refused."""

    # strict: no "1" -> 1 or false -> 0 coercions; a value is accepted only if the schema allows it.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    # Fields of other servers' APIs this body refuses unless they hold their no-op value (kept in
    # ``_refused_values`` for ``refuse_unsupported``; they are not logged as unknown).
    _refused: ClassVar[frozenset[str]] = frozenset()
    _refused_values: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        # A field conveyor does not know is dropped, but said so in the log: a client that counts
        # on it (a newer API's field, a typo of a known one) can be found from the server's side.
        body = handler(data)
        if isinstance(data, dict):
            for name, value in data.items():
                if name in cls._refused:
                    body._refused_values[name] = value
                elif isinstance(name, str) and name not in cls.model_fields:
                    _log_unknown(cls.__name__, name)
        return body


class TextContent(_Body):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ImageURL(_Body):
    """Where an image part's image is: a ``data:image/...;base64,...`` URL, or an http(s) URL the
    server fetches (within its limits; a server may turn fetching off)."""

    url: Text
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; the model's own "
                                                          "preprocessing decides the resolution.")


class ImageContent(_Body):
    """An image part of a message's content (a vision-language model's input)."""

    type: Literal["image_url"]
    image_url: ImageURL


def _part_kind(part: Any) -> str:
    """The branch a content part validates as, by its ``type`` (any type but image_url is held to
    the text part's rules, so an unknown one is refused naming ``type``); the branch's class
    name, which the 400's field path leaves out (``services/http/validation.py``)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "ImageContent" if kind == "image_url" else "TextContent"


ContentPart = Annotated[Annotated[TextContent, Tag("TextContent")] | Annotated[ImageContent, Tag("ImageContent")],
                        Discriminator(_part_kind)]


# OpenAI's rule for a function's name; it is written into prompts and grammars as is.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCallIn(_Body):
    """A call's function in an assistant message of the history: ``arguments`` is JSON text."""

    name: FunctionName
    arguments: Text = "{}"


class ToolCallIn(_Body):
    """A tool call the assistant made earlier in the conversation."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    """One message of a conversation ("developer" is OpenAI's newer name for "system")."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant message's calls (content may be "
                                                "null).")
    tool_call_id: Text | None = Field(None, description="A tool message's: the call it answers.")

    def to_wire(self) -> dict[str, Any]:
        """The {role, content, ...} dict the tokenizer stage's chat template takes: tool calls,
        the call id a tool result answers and a name are kept for templates that render them."""
        content = self.content
        if isinstance(content, list) and any(part.type == "image_url" for part in content):
            # parts kept, in order: the tokenizer stage places each image where its part is
            content = [{"type": "text", "text": part.text} if part.type == "text"
                       else {"type": "image_url", "image_url": {"url": part.image_url.url}} for part in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)  # as vLLM and LMDeploy merge parts
        role = "system" if self.role == "developer" else self.role
        wire: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            wire["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                  for c in self.tool_calls]
        if self.tool_call_id is not None:
            wire["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            wire["name"] = self.name
        return wire


class FunctionSpec(_Body):
    """A function the model may call: ``parameters`` is a JSON Schema of its arguments (an object)."""

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted; arguments match the schema under tool_choice "
                                "required or a named function (grammar-enforced), and are parsed as printed under "
                                "auto.")


class ToolSpec(_Body):
    """One of OpenAI's ``tools``: only functions."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    """The function a named tool_choice picks."""

    name: FunctionName


class NamedToolChoice(_Body):
    """tool_choice naming one function: the output is a call to it."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    """OpenAI's stream_options."""

    include_usage: bool = False


# guided_decoding_backend values that ask for what conveyor does: its one backend, xgrammar, with
# compact JSON (vLLM's old "backend:option" spelling of that).
_NO_OP_BACKENDS = (None, "", "auto", "xgrammar", "xgrammar:disable-any-whitespace")
_EMPTY = (None, False, "", [], {})  # what a client sends for "not used"
# vLLM's and SGLang's fields conveyor does not implement: the values that mean "not used", and
# what to do instead. A field here is refused only when the request sets it to something else.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "prompt_logprobs": ((None,), "the prompt's logprobs are not computed; send null (pipeline().get_ppl scores "
                                 "a prompt offline)"),
    "truncate_prompt_tokens": ((None,), "prompts are not truncated; shorten the prompt (one longer than the "
                                        "context is a 400 naming its length)"),
    "allowed_token_ids": (_EMPTY, "not supported; constrain the output with guided_choice, guided_regex or "
                                  "response_format"),
    "logits_processors": (_EMPTY, "custom logits processors are not supported; constrain the output with "
                                  "guided_* or response_format"),
    "return_tokens_as_token_ids": (_EMPTY, "not supported; logprobs carry each token's text (and its bytes)"),
    "request_id": ((None,), "conveyor names each request itself (the response's id); leave it out"),
    "cache_salt": ((None,), "the prefix cache is not salted per request; leave it out (run a separate server "
                            "for tenants that must not share the cache)"),
    "kv_transfer_params": ((None,), "no disaggregated prefill/decode; leave it out"),
    "vllm_xargs": (_EMPTY, "no custom extensions; leave it out"),
    "mm_processor_kwargs": (_EMPTY, "no multimodal inputs; leave it out"),
    "lora_path": ((None,), "a LoRA adapter is not loaded per request; load it once (POST /v1/load_lora_adapter "
                           "or --adapters name=path) and name it in `model` (or serve a merged model)"),
    "return_hidden_states": ((None, False), "hidden states are not returned; leave it out"),
    "structural_tag": ((None,), "structural tags are not supported; use response_format json_schema, "
                                "guided_regex or guided_grammar"),
}


class _SamplingBody(_Body):
    """Sampling fields shared by chat and text completions (None means the default)."""

    _refused: ClassVar[frozenset[str]] = frozenset(_REFUSED)

    model: str | None = Field(None, description="The served model's name, or a LoRA adapter's (GET /v1/models); "
                              "omitted: the served model.")
    adapter_name: str | None = Field(None, description="LMDeploy's: the LoRA adapter to run with (as `model` naming "
                                     "it); null: the one `model` names, else the base model.")
    temperature: float | None = Field(None, le=2, description="OpenAI's range [0, 2]. "
                                      f"Default {OPENAI_DEFAULTS.temperature}; 0 is greedy.")
    top_p: float | None = Field(None, description=f"In (0, 1]. Default {OPENAI_DEFAULTS.top_p}.")
    top_k: TopK | None = Field(None, description=f"Extension. Default {OPENAI_DEFAULTS.top_k}; 0 or -1: no "
                               "top-k limit.")
    min_p: float | None = Field(None, description=f"Extension. In [0, 1]. Default {OPENAI_DEFAULTS.min_p:g}.")
    n: int_in(1, MAX_N) | None = Field(None, description="Choices to generate. Default 1.")
    stop: StopOrFalse = Field(None, description="Strings that end generation (not returned); false: none.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int_in(0, MAX_SEED) | None = Field(None, description="Choice i uses seed + i.")
    user: str | None = Field(None, description="An end-user id: its QoS group and quota when the server has "
                             "--qos-config-path, else only for the client's records.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: only null or {}.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0: use repetition_penalty.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0: use repetition_penalty.")
    repetition_penalty: float | None = Field(None, description="Extension. In [0.01, 100]; default "
                                             f"{OPENAI_DEFAULTS.repetition_penalty} (off).")
    ignore_eos: bool = Field(False, description="Extension: keep generating past the end-of-sequence token.")
    skip_special_tokens: bool = Field(True, description="Extension.")
    min_new_tokens: int_in(0, INT32_MAX) | None = Field(None, description="Extension.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension: token ids that end generation.")
    include_stop_str_in_output: bool = Field(False, description="Extension: keep the matched stop string.")
    session_id: int_in(-1, 2**53 - 1) | None = Field(
        None, description="LMDeploy's: only -1 (no session); a conversation kept on the server is "
                          "/v1/chat/interactive's.")
    # Constrained output: at most one of these per request (protocol/guided.py reads each).
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": '
                          '{"name": ..., "schema": {...}, "strict": true}}: the output matches it (compact JSON).')
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM's: the output matches this JSON Schema.")
    guided_regex: str | None = Field(None, description="vLLM's: the output matches this regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM's: the output matches this EBNF grammar (GBNF, "
                                       "start rule root).")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's newer spelling: one of json, regex, choice, grammar, json_object.")
    regex: str | None = Field(None, description="SGLang's guided_regex.")
    ebnf: str | None = Field(None, description="SGLang's guided_grammar.")
    json_schema: str | dict[str, Any] | None = Field(None, description="SGLang's guided_json.")
    guided_decoding_backend: str | None = Field(None, description='Only "xgrammar" (or "auto"): conveyor\'s one '
                                                "backend.")
    guided_whitespace_pattern: str | None = Field(None, description="Not supported: JSON output is compact.")
    # vLLM's / SGLang's sampling extensions.
    min_tokens: int_in(0, INT32_MAX) | None = Field(None, description="vLLM's min_new_tokens.")
    bad_words: list[NonEmptyStr] | None = Field(None, description="Extension: words never generated.")
    no_stop_trim: bool = Field(False, description="SGLang's include_stop_str_in_output.")
    best_of: int_in(1, MAX_N) | None = Field(None, description="Only n (or null): every generated choice is "
                                             "returned.")
    use_beam_search: bool = Field(False, description="Only false: no beam search.")
    length_penalty: float | None = Field(None, description="Only 1 (it applies to beam search).")
    spaces_between_special_tokens: bool = Field(True, description="Only true.")
    priority: int | None = Field(None, description="vLLM's: only 0; the server's QoS config (--qos-config-path) "
                                 "orders requests by user.")

    @property
    def num_choices(self) -> int:
        """n, defaulted."""
        return self.n or 1

    @property
    def wants_usage_chunk(self) -> bool:
        """A streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """Raise InvalidRequestError for a field set to something the engine would not honour."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed with stream: true", param="stream_options")
        if self.session_id not in (None, -1):
            raise InvalidRequestError(f"session_id={self.session_id}: this endpoint keeps no session (send -1 or "
                                      "leave it out); for a conversation the server remembers, use "
                                      "/v1/chat/interactive with interactive_mode", param="session_id")
        if self.best_of not in (None, self.num_choices):
            raise InvalidRequestError(f"best_of={self.best_of}: conveyor returns every choice it generates; ask "
                                      f"for n={self.best_of} and pick the best on your side (or send best_of = n)",
                                      param="best_of")
        if self.use_beam_search:
            raise InvalidRequestError("use_beam_search: no beam search; sample n choices (n, temperature, seed) or "
                                      "decode greedily (temperature 0)", param="use_beam_search")
        if self.length_penalty not in (None, 1.0):
            raise InvalidRequestError("length_penalty: it scores beam search, which conveyor does not do; send 1 "
                                      "or leave it out", param="length_penalty")
        if not self.spaces_between_special_tokens:
            raise InvalidRequestError("spaces_between_special_tokens: false is not supported (special tokens are "
                                      "decoded as the tokenizer decodes them); leave it out, or drop them with "
                                      "skip_special_tokens", param="spaces_between_special_tokens")
        if self.priority not in (None, 0):
            raise InvalidRequestError(f"priority={self.priority}: a request's priority comes from its `user` in the "
                                      "server's QoS config (--qos-config-path); send 0 or leave it out",
                                      param="priority")
        if self.min_tokens is not None and self.min_new_tokens not in (None, self.min_tokens):
            raise InvalidRequestError("min_tokens and min_new_tokens differ: they are one setting; send one",
                                      param="min_tokens")
        if self.guided_whitespace_pattern is not None:
            raise InvalidRequestError("guided_whitespace_pattern: not supported; conveyor's JSON output is compact "
                                      "(no whitespace between tokens): leave it out", param="guided_whitespace_pattern")
        if self.guided_decoding_backend not in _NO_OP_BACKENDS:
            raise InvalidRequestError(f"guided_decoding_backend={self.guided_decoding_backend!r}: conveyor has one "
                                      'backend, xgrammar; send "xgrammar" or leave it out',
                                      param="guided_decoding_backend")
        for name, value in self._refused_values.items():
            no_op, alternative = _REFUSED.get(name, ((value,), ""))
            if value not in no_op:
                raise InvalidRequestError(f"{name}: {alternative}", param=name)

    @functools.cached_property
    def guide(self) -> Guide | None:
        """The request's output constraint, from whichever one field gives it (400 for two)."""
        found: list[tuple[str, Guide]] = []
        if self.response_format is not None:
            guide = guide_from_response_format(self.response_format)
            if guide is not None:
                found.append(("response_format", guide))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                found.append((name, guide_from_fields(name, value)))
        if self.json_schema is not None:  # SGLang's: a schema (or its text), read as response_format's
            found.append(("json_schema", guide_from_response_format(
                {"type": "json_schema", "json_schema": {"schema": self.json_schema}}, "json_schema")))
        found += _structured_outputs(self.structured_outputs)
        if len(found) > 1:
            names = " and ".join(name for name, _ in found)
            raise InvalidRequestError(f"{names}: one output constraint per request; send one of them",
                                      param=found[1][0])
        return found[0][1] if found else None

    def sampling_params(self, max_new_tokens: int, logprobs: int | None, choice: int = 0) -> SamplingParams:
        """The engine's parameters for choice ``choice`` (its seed is seed + choice), validated."""
        self.refuse_unsupported()
        if self.logit_bias:
            raise InvalidRequestError("logit_bias: not supported; ban tokens with bad_token_ids or "
                                      "favour none (send null or {})", param="logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name}={getattr(self, name)!r}: not supported; use "
                                          "repetition_penalty (> 1 discourages repeats)", param=name)
        d = OPENAI_DEFAULTS
        return checked(SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=_given(self.min_new_tokens, _given(self.min_tokens, d.min_new_tokens)),
            temperature=_given(self.temperature, d.temperature),
            top_k=_given(self.top_k, d.top_k),
            top_p=_given(self.top_p, d.top_p),
            min_p=_given(self.min_p, d.min_p),
            repetition_penalty=_given(self.repetition_penalty, d.repetition_penalty),
            ignore_eos=self.ignore_eos,
            random_seed=None if self.seed is None else self.seed + choice,
            stop_words=_stop_list(self.stop),
            bad_words=list(self.bad_words or []),
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            guide=self.guide,
        ))


def _structured_outputs(spec: dict[str, Any] | None) -> list[tuple[str, Guide]]:
    """The constraints in vLLM's ``structured_outputs`` object (its options that ask for what
    conveyor does are accepted; others, and unknown keys, are refused)."""
    found: list[tuple[str, Guide]] = []
    for key, value in (spec or {}).items():
        param = f"structured_outputs.{key}"
        if key in ("json", "regex", "choice", "grammar"):
            if value is not None:
                found.append((param, guide_from_fields(param, value)))
        elif key == "json_object":
            if value:
                found.append((param, Guide("json_object")))
        elif key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            # Permissions or conveyor's own behaviour (no fallback: a bad constraint is a 400;
            # compact JSON; the schema's properties only): either value is honoured.
            if not isinstance(value, bool | None):
                raise InvalidRequestError(f"{param} must be a boolean", param="structured_outputs")
        elif key in ("whitespace_pattern", "structural_tag", "backend"):
            if value not in (None, "") and not (key == "backend" and value in _NO_OP_BACKENDS):
                raise InvalidRequestError(f"{param}: not supported (conveyor's JSON output is compact and its one "
                                          "backend is xgrammar); leave it out", param="structured_outputs")
        else:
            raise InvalidRequestError(f"{param}: unknown; structured_outputs takes one of json, regex, choice, "
                                      "grammar, json_object", param="structured_outputs")
    return found


# The OpenAI name of each SamplingParams field whose name differs, for error messages.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "random_seed": "seed", "stop_words": "stop",
                 "logprobs": "top_logprobs"}


def _given(value: Any, default: Any) -> Any:
    """A body's field, or the default where the body left it out (None)."""
    return default if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def checked(params: SamplingParams) -> SamplingParams:
    """``validate(params)``, its error naming the request body's field rather than the engine's."""
    try:
        return validate(params)
    except InvalidRequestError as exc:
        if exc.param not in SamplingParams.__struct_fields__:  # already the body's name (response_format)
            raise
        name = _OPENAI_NAMES.get(exc.param, exc.param)
        raise InvalidRequestError(f"{name}: {str(exc).split(': ', 1)[-1]} (got {getattr(params, exc.param)!r})",
                                  param=name) from None


class ChatCompletionRequest(_SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int_in(1, INT32_MAX) | None = Field(None,
                                   description="Default: as many as the context length leaves.")
    max_completion_tokens: int_in(1, INT32_MAX) | None = Field(None, description="Wins over max_tokens.")
    logprobs: bool | None = False
    top_logprobs: int_in(0, MAX_TOP_LOGPROBS) | None = Field(None, description="Ignored unless logprobs is true.")
    tools: list[ToolSpec] | None = Field(None, description="Functions the model may call; its calls come back in "
                                         "message.tool_calls (finish_reason tool_calls).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (default with tools): the model decides; "none": no calls; "required" or '
                          '{"type": "function", "function": {"name": ...}}: a call, enforced by a grammar.')
    parallel_tool_calls: bool | None = Field(None, description="Default true; false: at most one call.")
    functions: list[dict[str, Any]] | None = Field(None, description="Only null or []: use tools (OpenAI's "
                                                   "newer name).")
    function_call: str | dict[str, Any] | None = Field(None, description="Only null: use tool_choice.")
    # The chat template's options (vLLM's and SGLang's).
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='Extra variables of the chat template, e.g. {"enable_thinking": false} for Qwen3.')
    add_generation_prompt: bool | None = Field(
        None, description="Default true: the prompt ends where the assistant speaks; false: after the last message.")
    continue_final_message: bool = Field(
        False, description="The prompt ends inside the last message, an assistant's, which the model continues "
                           "(its text is not repeated in the output).")
    echo: bool = Field(False, description="Only false on chat: the request's messages are the client's already.")
    add_special_tokens: bool = Field(False, description="Only false: the chat template writes the special tokens "
                                     "(the tokenizer adds a BOS only where the template has none).")
    documents: list[Any] | None = Field(None, description="Not supported: put the documents' text in a message.")
    chat_template: str | None = Field(None, description="Not supported: the server's template is set at start "
                                      "(--chat-template).")

    def refuse_unsupported(self) -> None:
        """Besides the shared checks: no function calling; the chat template's options as it can take them."""
        super().refuse_unsupported()
        check_template_kwargs(self.chat_template_kwargs)
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError("continue_final_message continues the last message, so no generation "
                                          "prompt follows it: send add_generation_prompt: false or leave it out",
                                          param="add_generation_prompt")
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError("continue_final_message: the last message must be the assistant's (the "
                                          "text the model continues)", param="messages")
        if self.echo:
            raise InvalidRequestError("echo: not supported on chat completions (your messages are in your request); "
                                      "leave it out, or use /v1/completions with echo", param="echo")
        if self.add_special_tokens:
            raise InvalidRequestError("add_special_tokens: the chat template writes the special tokens and conveyor "
                                      "adds a BOS only where it has none; send false or leave it out",
                                      param="add_special_tokens")
        if self.documents:
            raise InvalidRequestError("documents: not passed to the chat template; put the documents' text in a "
                                      "system or user message", param="documents")
        if self.chat_template is not None:
            raise InvalidRequestError("chat_template: the server's chat template is set when it starts "
                                      "(--chat-template, or the model's own); leave it out", param="chat_template")
        if self.functions:
            raise InvalidRequestError("functions: OpenAI's older name; send them as tools, "
                                      '[{"type": "function", "function": {...}}]', param="functions")
        if self.function_call is not None:
            raise InvalidRequestError("function_call: OpenAI's older name; send tool_choice (\"auto\", \"none\", "
                                      '"required" or {"type": "function", "function": {"name": ...}})',
                                      param="function_call")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"tools: function names must differ, got {', '.join(names)}", param="tools")

    @property
    def tools_wire(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI's JSON (what chat templates take), None for none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def tool_choice_wire(self) -> str | dict[str, Any] | None:
        """tool_choice as OpenAI's JSON."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @property
    def template_options(self) -> dict[str, Any]:
        """The GenerateReq fields of the chat template's options."""
        return {"chat_template_kwargs": self.chat_template_kwargs or None,
                "add_generation_prompt": not self.continue_final_message and self.add_generation_prompt is not False,
                "continue_final_message": self.continue_final_message}

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token the engine must report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingBody):
    """POST /v1/completions (legacy text completions)."""

    prompt: (NonEmptyStr | NonEmpty[list[NonEmptyStr]] | NonEmpty[list[TokenId]]
             | NonEmpty[list[NonEmpty[list[TokenId]]]]) = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists.")
    max_tokens: int_in(1, INT32_MAX) | None = Field(16, description="Default 16, as OpenAI's.")
    echo: bool = Field(False, description="Prepend the prompt to the text (the prompt gets no logprobs).")
    logprobs: int_in(0, MAX_COMPLETION_LOGPROBS) | None = None
    suffix: str | None = Field(None, description="Only null or empty: text insertion is not supported.")
    add_special_tokens: bool = Field(True, description="Only true: a text prompt is encoded with the tokenizer's "
                                     "special tokens (BOS); send token ids for exact control.")

    def refuse_unsupported(self) -> None:
        """Besides the shared checks: special tokens as the tokenizer adds them."""
        super().refuse_unsupported()
        if not self.add_special_tokens:
            raise InvalidRequestError("add_special_tokens: false is not supported for text prompts; send the "
                                      "prompt as token ids to choose every token", param="add_special_tokens")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per element of a batch (a token list is one prompt)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class InteractiveRequest(_Body):
    """POST /v1/chat/interactive, LMDeploy's stateful chat (its ``GenerateRequest``) plus ``end``."""

    # Rules across fields, stated in the schema too: a prompt is required (non-empty) unless the
    # request only cancels or ends; cancel needs a real session_id.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"cancel": {"const": False}, "end": {"const": False}}},
         "then": {"required": ["prompt"],
                  "properties": {"prompt": {"type": ["string", "array"], "minLength": 1, "minItems": 1}}}},
        {"if": {"properties": {"cancel": {"const": True}}, "required": ["cancel"]},
         "then": {"required": ["session_id"], "properties": {"session_id": {"minimum": 0}}}},
    ]})

    prompt: Text | list[ChatMessage] | None = Field(
        None, description="This turn's text, or messages; required unless cancel or end.")
    session_id: int_in(-1, 2**53 - 1) = Field(-1, description="-1: a fresh session.")
    interactive_mode: bool = Field(False, description="True: keep the history on the server for the next turn.")
    stream: bool = False
    stop: StopOrFalse = Field(None, description="Strings that end generation (not returned); false: none.")
    request_output_len: int_in(1, INT32_MAX) | None = Field(
        None, description=f"Most tokens to generate. Default {INTERACTIVE_DEFAULTS.max_new_tokens}.")
    top_p: float = Field(INTERACTIVE_DEFAULTS.top_p, description="In (0, 1].")
    top_k: TopK = Field(INTERACTIVE_DEFAULTS.top_k, description="0 or -1: no top-k limit.")
    temperature: float = Field(INTERACTIVE_DEFAULTS.temperature, description="0 is greedy.")
    repetition_penalty: float = Field(INTERACTIVE_DEFAULTS.repetition_penalty,
                                      description="In [0.01, 100]; 1.0 is off.")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cancel: bool = Field(False, description="Abort the session's running turn.")
    adapter_name: str | None = Field(None, description="The LoRA adapter to run with (GET /v1/models lists them); "
                                     "null: the base model.")
    seed: int_in(0, MAX_SEED) | None = None
    end: bool = Field(False, description="Extension: end the session and free its cache.")
    user_id: str | None = Field(None, description="The QoS user (LMDeploy's name): its group and quota when the "
                                "server has --qos-config-path.")

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters of this turn, validated."""
        return checked(SamplingParams(
            max_new_tokens=_given(self.request_output_len, INTERACTIVE_DEFAULTS.max_new_tokens),
            temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            random_seed=self.seed, stop_words=_stop_list(self.stop), skip_special_tokens=self.skip_special_tokens))


# ---- responses ---------------------------------------------------------------------------------

FinishReason = Literal[FINISH_REASONS]  # the OpenAI spelling of protocol.Finish


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a response (a prompt counts once however many choices it has)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    """One alternative token."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The chosen token and its alternatives."""

    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    """A call's function: ``arguments`` is JSON text of an object."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A call the model made."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The generated message: with a reasoning parser, the thinking is ``reasoning_content``;
    with tools, the calls are ``tool_calls`` and ``content`` is null when nothing else was said."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    """Response of POST /v1/chat/completions without streaming."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    """Legacy completion logprobs: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    """One choice of a text completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """Response of POST /v1/completions without streaming."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class InteractiveResponse(BaseModel):
    """Response of /v1/chat/interactive (streamed: one such JSON object per line, ``text`` the delta)."""

    text: str
    tokens: int = 0  # generated so far in this turn
    input_tokens: int = 0  # this turn's prompt
    history_tokens: int = 0  # the session's tokens before this turn
    finish_reason: FinishReason | None = None
    session_id: int | None = None  # extension: the id a session_id=-1 request was given


class LoadLoraAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: NonEmptyStr = Field(max_length=256, description="The name requests give in `model` "
                                   "(or `adapter_name`).")
    lora_path: NonEmptyStr = Field(description="The PEFT LoRA checkpoint directory, on the server's host.")


class UnloadLoraAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; adapters are known by name, so lora_int_id is refused)."""

    lora_name: NonEmptyStr = Field(max_length=256, description="The adapter to forget.")
    lora_int_id: int | None = Field(None, description="vLLM's: only null (adapters are unloaded by name).")


class ModelCard(BaseModel):
    """One served model: the base model (``parent`` null) or a LoRA adapter on it (``parent`` the
    base model's id, ``root`` the adapter's checkpoint path where the server knows it)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = []


class ModelList(BaseModel):
    """Response of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """Response of GET /health when the server takes requests."""

    status: Literal["ok"] = "ok"
