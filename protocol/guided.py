"""Constrained output: what a request's text must match, as the wire carries it.

A ``Guide`` names a kind of constraint and its text; the engine compiles it against the
model's vocabulary (``engine/grammar.py``, with xgrammar) and masks every token that would
leave it. The request bodies' many spellings (OpenAI's ``response_format``, vLLM's and SGLang's
``guided_*`` and ``structured_outputs``, LMDeploy's ``GenerationConfig.response_format``) all
come down to one ``Guide`` through the functions here, so the pipeline and the server read
them the same way. Syntax (is the schema valid JSON Schema, does the regex parse) is checked
by the tokenizer stage, which compiles nothing for the engine; this module checks only shape.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from .errors import InvalidRequestError

# json_object: any JSON object. json_schema: a JSON Schema (its JSON text). regex: a regular
# expression the whole output matches. choice: one of a list of strings (its JSON text).
# grammar: an EBNF grammar (GBNF / xgrammar dialect) whose start rule is ``root``.
GUIDE_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_GUIDE_CHARS = 1 << 20  # a schema or grammar's text: 1 MiB, far past any real one


class Guide(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """One request's output constraint. ``spec`` is empty only for ``json_object``."""

    kind: str
    spec: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """What the engine caches a compiled grammar under."""
        return self.kind, self.spec


def check_guide(guide: Guide, param: str = "response_format") -> Guide:
    """Raise InvalidRequestError when ``guide``'s shape is wrong; return it."""
    if guide.kind not in GUIDE_KINDS:
        raise InvalidRequestError(f"{param}: unknown kind {guide.kind!r}; one of {', '.join(GUIDE_KINDS)}",
                                  param=param)
    if guide.kind != "json_object" and not guide.spec:
        raise InvalidRequestError(f"{param}: the {guide.kind} is empty", param=param)
    if len(guide.spec) > MAX_GUIDE_CHARS:
        raise InvalidRequestError(f"{param}: the {guide.kind} is {len(guide.spec)} characters, more than the "
                                  f"{MAX_GUIDE_CHARS} allowed", param=param)
    if guide.kind == "choice":
        try:
            choices = json.loads(guide.spec)
        except ValueError:
            choices = None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError(f"{param}: choice must be a non-empty list of non-empty strings", param=param)
    return guide


def _schema_text(schema: Any, param: str) -> str:
    """A JSON Schema given as an object (dict or bool) or as its JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: the schema is not valid JSON ({exc})", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{param}: a JSON Schema is an object, got {type(schema).__name__}", param=param)
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)  # one text per schema: one cache entry


def guide_from_response_format(response_format: dict[str, Any] | None, param: str = "response_format") -> Guide | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``json_schema:
    {name, schema, strict}``), and LMDeploy's ``regex_schema`` (``{"type": "regex_schema",
    "regex_schema": "..."}``), as a Guide; ``None`` for plain text.

    ``strict`` is accepted either way: the output always matches the schema (constrained
    decoding cannot do less), so ``strict: false`` gets what ``true`` promises."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequestError(f"{param}: an object with a 'type' is expected", param=param)
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise InvalidRequestError(f'{param}: json_schema needs {{"json_schema": {{"name": ..., "schema": '
                                      '{...}}}', param=param)
        if not isinstance(body.get("strict", False), (bool, type(None))):
            raise InvalidRequestError(f"{param}.json_schema.strict must be a boolean", param=param)
        return check_guide(Guide("json_schema", _schema_text(body["schema"], param)), param)
    if kind == "regex_schema":  # LMDeploy's
        return check_guide(Guide("regex", _text(response_format.get("regex_schema"), f"{param}.regex_schema")), param)
    raise InvalidRequestError(f"{param}: type {kind!r} is not one of text, json_object, json_schema, regex_schema",
                              param=param)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return value


def guide_from_fields(param: str, value: Any) -> Guide:
    """vLLM's / SGLang's single fields: ``guided_json`` / ``json`` (a schema object or its text),
    ``guided_regex`` / ``regex``, ``guided_choice`` / ``choice`` (a list of strings),
    ``guided_grammar`` / ``grammar`` / ``ebnf`` (EBNF text). ``param`` is the field's name."""
    name = param.rsplit(".", 1)[-1].removeprefix("guided_")
    if name == "json":
        return check_guide(Guide("json_schema", _schema_text(value, param)), param)
    if name == "regex":
        return check_guide(Guide("regex", _text(value, param)), param)
    if name == "choice":
        if not isinstance(value, list):
            raise InvalidRequestError(f"{param} must be a list of strings", param=param)
        return check_guide(Guide("choice", json.dumps(value, ensure_ascii=False)), param)
    if name in ("grammar", "ebnf"):
        return check_guide(Guide("grammar", _text(value, param)), param)
    raise InvalidRequestError(f"{param}: not a constraint conveyor knows", param=param)
