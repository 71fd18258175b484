"""Prompt preprocessing: chat template, tokenization, stop/bad words as token ids.

Library code shared by the offline pipeline (in-process) and the tokenizer worker process.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.engine.errors import InvalidRequestError
from conveyor.engine.sampling_params import SamplingParams
from conveyor.services.chat_template import ChatTemplateConfig, get_chat_template

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, Any]]


def load_tokenizer(model_path: str | Path):
    """A transformers tokenizer from a model directory or a single .gguf file."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def _generation_eos_ids(model_path: Path) -> list[int]:
    """eos ids from generation_config.json (chat models often add their end-of-turn token there)."""
    gen = model_path / "generation_config.json"
    if not gen.exists():
        return []
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


@dataclass
class PreparedRequest:
    """A prompt ready for the engine, plus what the detokenizer needs."""

    token_ids: list[int]
    params: SamplingParams
    stop_strings: list[str] = field(default_factory=list)


class Preprocessor:
    """Turns user prompts and generation settings into token ids and SamplingParams."""

    def __init__(self, model_path: str | Path, chat_template_config: ChatTemplateConfig | None = None,
                 model_eos_ids: list[int] | None = None):
        self.model_path = Path(model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.template = get_chat_template(str(self.model_path), chat_template_config, self.tokenizer)
        eos = list(model_eos_ids or [])
        eos += _generation_eos_ids(self.model_path) if self.model_path.is_dir() else []
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        # The template's end-of-turn words that are single tokens stop in the engine directly.
        for word in self.template.stop_words:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
            if len(ids) == 1:
                eos.append(ids[0])
        self.eos_token_ids = sorted(set(eos))
        self.vocab_size = len(self.tokenizer)

    def render(self, prompt: Prompt, do_preprocess: bool = True, sequence_start: bool = True) -> str:
        """Apply the chat template (or not) to a string or an OpenAI message list."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: give some text", param="prompt")
            return self.template.messages2prompt(prompt, sequence_start) if do_preprocess else prompt
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise InvalidRequestError(
                "a prompt must be a non-empty string or a non-empty list of "
                "{'role': ..., 'content': ...} messages", param="messages")
        for m in prompt:
            if m.get("role") not in ("system", "user", "assistant", "tool") or "content" not in m:
                raise InvalidRequestError(
                    f"bad message {m!r}: each needs a role (system/user/assistant) and content",
                    param="messages")
        try:
            return self.template.messages2prompt(prompt, sequence_start)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc

    def encode(self, prompt: Prompt, do_preprocess: bool = True, sequence_start: bool = True) -> list[int]:
        """Token ids of a prompt after the chat template."""
        text = self.render(prompt, do_preprocess, sequence_start)
        # Templated text already carries every special token it needs (BOS included, where the
        # template renders it); a continuation turn of a session must not get a second BOS.
        add_special = sequence_start and not getattr(self.template, "includes_bos", False)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special)
        if not ids:
            raise InvalidRequestError("the prompt encodes to no tokens", param="prompt")
        return ids

    def sampling_params(self, *, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                        min_p: float = 0.0, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                        random_seed: int | None = None, min_new_tokens: int | None = None,
                        stop_words: list[str] | None = None, bad_words: list[str] | None = None,
                        stop_token_ids: list[int] | None = None, bad_token_ids: list[int] | None = None,
                        logprobs: int | None = None) -> tuple[SamplingParams, list[str]]:
        """SamplingParams with words turned into ids, and the stop strings left for the detokenizer."""
        stops = [] if ignore_eos else list(self.eos_token_ids)
        stops += list(stop_token_ids or [])
        bad_single, bad_seqs = list(bad_token_ids or []), []
        for word in bad_words or []:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
            (bad_single.extend(ids) if len(ids) == 1 else bad_seqs.append(ids))
        for tid in stops + bad_single:
            if not 0 <= tid < self.vocab_size:
                raise InvalidRequestError(f"token id {tid} is outside the vocabulary [0, {self.vocab_size})")
        params = SamplingParams(
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or 0,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, random_seed=random_seed,
            stop_token_ids=sorted(set(stops)), bad_token_ids=sorted(set(bad_single)),
            bad_sequences=bad_seqs, logprobs=logprobs,
        )
        return params, list(stop_words or [])
