"""pydantic's validation errors as one readable message that names the field, for a 400."""

from __future__ import annotations

import re
from typing import Any

_UNION_TAG = re.compile(r"[\[(]|^(str|int|float|bool|bytes|dict|list|none)$|^[A-Z]")


def _field_path(loc: Any) -> list[str]:
    # Drop the leading "body" and union branches ('str', 'list[int]', 'TextContent', ...), which
    # mean nothing to a user.
    items = list(loc or ())[1:] if list(loc or ("",))[0] == "body" else list(loc or ())
    return [str(p) for p in items if not (isinstance(p, str) and _UNION_TAG.search(p))]


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message naming the field, and the field's path, for a RequestValidationError."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind, msg = first.get("type", ""), str(first.get("msg", "")).removeprefix("Value error, ")
    path = _field_path(first.get("loc"))
    if kind == "json_invalid":
        where = f" at position {path[0]}" if path else ""
        return f"malformed JSON in the request body{where}: {first.get('ctx', {}).get('error', msg)}", None
    if not path:
        if kind == "missing":
            return "the request body is missing: send a JSON object (Content-Type: application/json)", None
        if kind == "value_error":  # a whole-body check; its message starts with the field it blames
            field = re.match(r"(\w+): ", msg)
            return msg, field.group(1) if field else None
        return "the request body must be a JSON object sent with Content-Type: application/json", None
    # Of a union's failed branches, the one that got deepest into the value says the most.
    deepest = max((e for e in errors if _field_path(e.get("loc"))[:len(path)] == path),
                  key=lambda e: len(_field_path(e.get("loc"))))
    if deepest is not first:
        first, path = deepest, _field_path(deepest.get("loc"))
        kind, msg = first.get("type", ""), str(first.get("msg", "")).removeprefix("Value error, ")
    param = ".".join(path)
    if kind == "missing":
        return f"{param}: field required", param
    # A union field fails once per branch: list each distinct reason.
    msgs = dict.fromkeys(str(e.get("msg", "")).removeprefix("Value error, ")
                         for e in errors if _field_path(e.get("loc")) == path)
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{param}: {', or '.join(msgs) or msg} (got {got})", param
