"""Constrained decoding in the engine: a request's ``Guide`` compiled against the vocabulary,
followed token by token, and turned each step into a mask of the tokens it allows.

Compilation (xgrammar: a JSON schema, regex or EBNF grammar to a token-level automaton with a
per-state mask cache) runs on a small thread pool, never on the step loop: xgrammar releases
the GIL while it compiles, and a request whose grammar is not ready yet simply waits in the
queue (``Sequence.admissible``) while the others run. Compiled grammars are cached by the
guide's text, so a schema every request shares is compiled once.

Why here and not in the tokenizer stage (where DESIGN.md first put it): a compiled grammar
carries its mask cache, 60 KB for a small schema and 3.5 MB for a 30-property one (measured
with SmolLM2's 49k vocabulary), which every request would carry over the wire and the engine
would deserialize anyway; compiling costs 2-10 ms a schema, once per schema. The tokenizer
stage parses each guide (``services/tokenizer/guide_syntax.py``), so a bad schema is still a
400 there, before the engine sees the request.

Each step, the engine fills one row of a bit mask per constrained row of the batch (32 tokens a
32-bit word, xgrammar's layout), moves it to the device behind the forward pass already queued,
and the sampler applies it to the logits (``apply_token_bitmask``) before anything else.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..protocol.guided import Guide

logger = logging.getLogger(__name__)

_CACHED_GRAMMARS = 512  # compiled grammars kept (least recently used dropped first)
_bits: dict[torch.device, torch.Tensor] = {}  # 0..31 on each device, made once: a copy per step from
# pageable host memory would make the host wait for the forward queued before it


def _choice_ebnf(spec: str) -> str:
    """One of a list of strings, as an EBNF grammar (each string a JSON-escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))


class GuideCompiler:
    """Compiles guides for one model's vocabulary on background threads, with a cache.

    The tokenizer (for its token strings) is loaded on first use, on the pool, so that an engine
    that never sees a constraint never pays for it. ``vocab_size`` is the model's logits width,
    which may exceed the tokenizer's (padded embeddings): the extra ids are never allowed.
    """

    def __init__(self, model_path: Path, vocab_size: int, threads: int = 2):
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def _get_compiler(self) -> Any:
        with self._compiler_lock:  # two pool threads may start at once; build it once
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, guide: Guide) -> Any:
        compiler = self._get_compiler()
        if guide.kind == "json_object":
            # Any object, written compactly: free whitespace lets a small model pad forever.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if guide.kind == "json_schema":
            return compiler.compile_json_schema(guide.spec, any_whitespace=False, strict_mode=True)
        if guide.kind == "regex":
            return compiler.compile_regex(guide.spec)
        if guide.kind == "choice":
            return compiler.compile_grammar(_choice_ebnf(guide.spec))
        if guide.kind == "grammar":
            return compiler.compile_grammar(guide.spec)
        raise ValueError(f"unknown guide kind {guide.kind!r}")

    def submit(self, guide: Guide) -> Future:
        """The compiled grammar of ``guide``, as a future (one per distinct guide, cached)."""
        future = self._cache.get(guide.key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(guide.key)
            return future
        future = self._pool.submit(self._compile, guide)
        self._cache[guide.key] = future
        while len(self._cache) > _CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GuideState:
    """One request's place in its grammar: the compile future, then a matcher fed every token
    the request keeps. ``stop_token_ids`` end the output once the grammar is complete."""

    def __init__(self, compiled: Future, stop_token_ids: list[int]):
        self.compiled = compiled
        self.stop_token_ids = list(stop_token_ids)
        self._matcher: Any = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed: ``error`` says)."""
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.compiled.done() else None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result(),
                                               override_stop_tokens=self.stop_token_ids or None)
        return self._matcher

    @property
    def terminated(self) -> bool:
        """The grammar took its end token: nothing more may follow."""
        return self._matcher is not None and self._matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))


def fill_token_bitmask(states: list[GuideState | None], vocab_size: int) -> torch.Tensor | None:
    """The step's mask, host side, from each row's guide state: int32 ``[len(states), ceil(vocab /
    32)]``, bit ``t % 32`` of word ``t // 32`` set where row ``i`` may take token ``t``. A row
    without a state (None) allows everything. None when no row is constrained."""
    guided = [(i, state) for i, state in enumerate(states) if state is not None]
    if not guided:
        return None
    mask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i, state in guided:
        if not state.terminated:
            state.matcher.fill_next_token_bitmask(mask, i)
    return mask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits`` (``[B, V]``, in place) to -inf wherever ``bitmask`` clears the token's bit."""
    vocab = logits.shape[-1]
    bits = _bits.get(bitmask.device)
    if bits is None:
        bits = _bits[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    return logits.masked_fill_(~allowed, float("-inf"))
