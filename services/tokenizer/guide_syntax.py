"""The tokenizer stage's check of a request's output constraint: does the schema, regex or
grammar parse? A bad one is the client's error (a 400 naming the problem), found here, before
the request reaches the engine; the engine compiles the same text against its vocabulary
(``engine/grammar.py``) and can then only fail on what this check cannot see.

The check builds xgrammar's ``Grammar`` from the text: the parse without the vocabulary, well
under a millisecond for real schemas, and cached by text, so repeated schemas cost nothing.
"""

from __future__ import annotations

import functools
import re

from ...protocol.errors import InvalidRequestError
from ...protocol.guided import Guide

# xgrammar's errors start with the C++ source position ("[04:18:13] /project/cpp/x.cc:83: ...")
# and a check's expression ("Check failed: (error.empty()) is false: "): noise to a client.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _client_message(exc: Exception) -> str:
    text = _SOURCE_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
    return text[:300]


@functools.lru_cache(maxsize=256)
def _parse_error(kind: str, spec: str) -> str | None:
    """None when ``spec`` parses as a ``kind``, else what is wrong with it."""
    import xgrammar as xgr  # imported on first use: most requests carry no constraint

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError for bad input
        return _client_message(exc)
    return None


def check_guide_syntax(guide: Guide, param: str = "response_format") -> Guide:
    """Raise InvalidRequestError when ``guide``'s text does not parse; return it. Its shape is
    ``protocol.guided.check_guide``'s, which ``validate`` runs first."""
    problem = _parse_error(guide.kind, guide.spec)
    if problem is not None:
        raise InvalidRequestError(f"{param}: the {guide.kind.replace('_', ' ')} is invalid: {problem}", param=param)
    return guide
