"""Incremental detokenization with UTF-8 safety and stop strings.

Tokens arrive a few at a time; the text shown to the user must be released
incrementally, never contain a broken character, and never leak part of a
stop string. Each new token is decoded inside a short window of preceding
tokens (``prefix_offset``..end) and only the text beyond the window's already
released part (``prefix_offset``..``read_offset``) is emitted, so per-token
work is O(window) and tokenizer context effects (SentencePiece leading
spaces, byte-fallback / byte-level pieces) render as in a full decode.

Caveat: concatenated output equals ``tokenizer.decode(output_ids)`` only when
decoding is *prefix-stable*: decoding ``ids[a:b]`` is a prefix of decoding
``ids[a:c]`` for ``c > b`` and the text of a window does not depend on tokens
before it beyond leading-space stripping. Byte-level BPE and Llama-style
SentencePiece tokenizers satisfy this; ``clean_up_tokenization_spaces=True``
(e.g. " ." -> ".") across a window boundary can differ from a full decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Prompt tokens used as initial context: enough that the first output token's
# leading space / byte pieces decode as they would after the full prompt.
PROMPT_CONTEXT_TOKENS = 6
# A UTF-8 char spans at most 4 bytes, so more held tokens than this still ending
# in U+FFFD means genuinely invalid bytes; release them to bound the window.
MAX_HELD_TOKENS = 8
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizeResult:
    """What one ``step`` produced."""

    text: str  # newly released text (safe to show the user now)
    stopped: bool  # a stop string was found; generation must end
    num_tokens: int  # output tokens to keep (after a stop: up to the completing one)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of safe text deltas.

    ``prompt_ids`` (its last few tokens) seed the decode window so the first
    output token renders as in ``decode(prompt + output)``; without them the
    output renders as in ``decode(output)``. ``stop_strings`` are matched on
    the decoded text across token boundaries.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True, stop_strings: list[str] | None = None,
                 include_stop_str: bool = False, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        # Ids the tokenizer does not know (a model's padded vocabulary, a bad peer) render as no
        # text, as a fast tokenizer renders them; a slow one would raise, and on every later step.
        self.vocab_size = len(tokenizer) if vocab_size is None else vocab_size
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = [s for s in (stop_strings or []) if s]
        self.include_stop_str = include_stop_str
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        context = [t for t in (prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:] if 0 <= t < self.vocab_size]
        self._ids: list[int] = context  # context + output tokens; trimmed from the left
        self._prefix_offset = 0  # window start (index into _ids)
        self._read_offset = len(context)  # text of _ids[:read_offset] is already emitted
        self._prefix_text = self._decode(context)
        self._num_output = 0  # output tokens fed so far
        self._pending = ""  # decoded text held back as a possible stop-string prefix
        self._released: list[str] = []
        self.stopped = False
        self.num_tokens = 0  # output tokens to keep; fixed once stopped

    @property
    def output_text(self) -> str:
        """All text released so far (by ``step`` and ``finish``)."""
        return "".join(self._released)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, force: bool) -> str:
        """Decode the window and return the stable new suffix ("" if held back)."""
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not force:
            # No growth (e.g. skipped special tokens): keep the window so the next
            # token still decodes with real context (SentencePiece leading space).
            if len(new_text) <= len(self._prefix_text):
                return ""
            # Trailing partial character: wait for the tokens that complete it,
            # unless the held run is too long to be one character.
            if (new_text.endswith(REPLACEMENT_CHAR)
                    and len(self._ids) - self._read_offset <= MAX_HELD_TOKENS):
                return ""
        delta = new_text[len(self._prefix_text):]
        # Slide the window; drop tokens before it so memory and work stay bounded.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _push_text(self, text: str) -> str:
        """Run new text through stop-string matching; return the releasable part."""
        if not self.stop_strings:
            return text
        # Any stop occurrence must end in `text`: its start lies in the held-back
        # suffix (held because it is a stop prefix) or in `text` itself.
        buf = self._pending + text
        hit, stop = -1, ""
        for s in self.stop_strings:
            i = buf.find(s)
            # Earliest start wins; on a tie the shorter stop completed first.
            if i != -1 and (hit == -1 or i < hit or (i == hit and len(s) < len(stop))):
                hit, stop = i, s
        if hit != -1:
            self.stopped = True
            self._pending = ""
            return buf[:hit + len(stop)] if self.include_stop_str else buf[:hit]
        # Hold back the longest suffix that could still grow into a stop string.
        keep = 0
        for k in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stop_strings):
                keep = k
                break
        self._pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def step(self, new_token_ids: list[int]) -> DetokenizeResult:
        """Feed newly generated tokens; return the text that is now safe to show."""
        out: list[str] = []
        for tok in new_token_ids:
            if self.stopped:
                break  # tokens after a stop never produce text
            self._num_output += 1
            self.num_tokens = self._num_output
            if not 0 <= tok < self.vocab_size:
                continue  # counted, never decoded (see __init__)
            self._ids.append(tok)
            delta = self._decode_new(force=False)
            if delta:
                out.append(self._push_text(delta))
        text = "".join(out)
        self._released.append(text)
        return DetokenizeResult(text, self.stopped, self.num_tokens)

    def finish(self) -> str:
        """Flush held-back text at request end and return it.

        Tokens held for an incomplete UTF-8 character are decoded as is (a
        trailing U+FFFD is released), and text held as a possible stop-string
        prefix is released since no further text can complete the stop.
        """
        if self.stopped:
            return ""
        text = ""
        if len(self._ids) > self._read_offset:
            text = self._push_text(self._decode_new(force=True))
        if not self.stopped:
            text += self._pending
            self._pending = ""
        self._released.append(text)
        return text
