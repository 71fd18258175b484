"""The tokenizer stage's logic: chat template, tokenization, words as token ids, validation.

``Preprocessor.prepare`` turns a GenerateReq into the TokenizedReq the engine takes; the
process loop around it is ``process.py``. The pipeline also uses ``render`` to check prompts
before it queues anything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
from jinja2 import TemplateError

from ...engine.hf_config import generation_eos_ids
from ...protocol.errors import InvalidRequestError, PromptTooLongError
from ...protocol.messages import GenerateReq, TokenizedReq
from ...protocol.sampling import SamplingParams, validate
from .chat_template import ChatTemplateConfig, check_template_kwargs, get_chat_template
from .guide_syntax import check_guide_syntax
from .images import ImageLimits
from .loader import load_tokenizer
from .multimodal import has_image_parts, image_prompt_for, image_sources, load_images

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")


def _is_content(content: Any) -> bool:
    """Whether a message's content is text: a str, or OpenAI parts whose text is a str (the
    wire types say only ``Any``, and a template fed anything else raises mid-render)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text", ""), str)
                                             for part in content)


class Preprocessor:
    """Turns requests (prompts and sampling parameters) into token ids for the engine."""

    def __init__(self, model_path: str | Path, session_len: int, chat_template_config: ChatTemplateConfig | None = None,
                 model_eos_ids: list[int] | None = None, image_limits: ImageLimits | None = None):
        self.model_path = Path(model_path)
        self.session_len = session_len
        self.tokenizer = load_tokenizer(self.model_path)
        self.template = get_chat_template(str(self.model_path), chat_template_config, self.tokenizer)
        # A vision-language model's way of putting images into prompts (None: a text model).
        self.image_prompt = image_prompt_for(self.model_path, self.tokenizer)
        self.image_limits = image_limits or ImageLimits()
        eos = list(model_eos_ids or [])
        eos += generation_eos_ids(self.model_path) if self.model_path.is_dir() else []
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        # The template's end-of-turn words that are single tokens stop in the engine directly.
        for word in self.template.stop_words:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
            if len(ids) == 1:
                eos.append(ids[0])
        self.eos_token_ids = sorted(set(eos))
        self.vocab_size = len(self.tokenizer)

    def render(self, prompt: Prompt, do_preprocess: bool = True, sequence_start: bool = True,
               chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        """Apply the chat template (or not) to a string or an OpenAI message list.

        ``chat_template_kwargs`` are the template's extra variables (Qwen3's ``enable_thinking``);
        ``add_generation_prompt=False`` ends the prompt after the last message;
        ``continue_final_message`` ends it inside the last (assistant) message (and wins over
        ``add_generation_prompt``); ``tools`` (OpenAI's function tools) are rendered by the
        template, which refuses them if it has no tool format."""
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   **check_template_kwargs(chat_template_kwargs)}
        if tools:
            options["tools"] = tools
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: give some text", param="prompt")
            return self.template.messages2prompt(prompt, sequence_start, **options) if do_preprocess else prompt
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise InvalidRequestError(
                "a prompt must be a non-empty string or a non-empty list of "
                "{'role': ..., 'content': ...} messages", param="messages")
        for m in prompt:
            if not isinstance(m.get("role"), str) or m["role"] not in ROLES or not _is_content(m.get("content")):
                raise InvalidRequestError(
                    f"bad message {repr(m)[:200]}: each needs a role (system/user/assistant/tool) and content "
                    "(a string, or a list of text parts)", param="messages")
        if has_image_parts(prompt):
            self._check_takes_images()
            prompt = self.image_prompt.messages_for_template(prompt, getattr(self.template, "reads_parts", False))
        try:
            return self.template.messages2prompt(prompt, sequence_start, **options)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError, TemplateError) as exc:  # a Jinja template refusing the conversation
            raise InvalidRequestError(str(exc)[:500], param="messages") from exc

    def encode(self, prompt: Prompt, do_preprocess: bool = True, sequence_start: bool = True,
               **template_options: Any) -> list[int]:
        """Token ids of a prompt after the chat template (``template_options``: ``render``'s)."""
        text = self.render(prompt, do_preprocess, sequence_start, **template_options)
        # Templated text already carries every special token it needs (BOS included, where the
        # template renders it); a continuation turn of a session must not get a second BOS.
        add_special = sequence_start and not getattr(self.template, "includes_bos", False)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special)
        if not ids:
            raise InvalidRequestError("the prompt encodes to no tokens", param="prompt")
        return ids

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """``params`` validated (a response format's schema, regex or grammar parsed), with the
        model's end ids added to ``stop_token_ids`` (unless ``ignore_eos``) and ``bad_words``
        turned into ``bad_token_ids`` and ``bad_sequences``."""
        validate(params, self.vocab_size)
        if params.guide is not None:
            check_guide_syntax(params.guide)
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        bad_single, bad_seqs = list(params.bad_token_ids), []
        for word in params.bad_words:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
            if len(ids) == 1:
                bad_single.extend(ids)
            elif ids:  # a word of no tokens can never be generated (and validate refuses an empty entry)
                bad_seqs.append(ids)
        return msgspec.structs.replace(params, stop_token_ids=sorted(set(stops)),
                                       bad_token_ids=sorted(set(bad_single)), bad_sequences=bad_seqs)

    def prepare(self, req: GenerateReq) -> TokenizedReq:
        """Validate and tokenize a request; raises ConveyorError subclasses on bad input.

        ``sequence_start=None`` (a session turn whose history the engine knows) renders the
        prompt as a continuation and, in ``first_turn_ids``, as a first turn.
        """
        first_turn_ids, images = None, []
        if req.input_ids is not None:
            if not req.input_ids:
                raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
            ids = list(req.input_ids)
        elif req.messages is not None or req.prompt is not None:
            prompt = req.messages if req.messages is not None else req.prompt
            options = {"chat_template_kwargs": req.chat_template_kwargs,
                       "add_generation_prompt": req.add_generation_prompt,
                       "continue_final_message": req.continue_final_message, "tools": req.tools}
            # Images are fetched and processed before the template runs: a bad one fails first.
            prepared = self._prepare_images(prompt)
            ids = self.encode(prompt, req.do_preprocess, bool(req.sequence_start), **options)
            if req.sequence_start is None:
                first_turn_ids = self.encode(prompt, req.do_preprocess, True, **options)
                first_turn_ids = None if first_turn_ids == ids else first_turn_ids  # e.g. a whole chat
            if prepared:
                ids, images = self.image_prompt.expand(ids, prepared)
                if first_turn_ids is not None:
                    first_turn_ids, first = self.image_prompt.expand(first_turn_ids, prepared)
                    shift = len(first_turn_ids) - len(ids)
                    if any(a.offset != b.offset + shift for a, b in zip(first, images)):
                        raise InvalidRequestError(
                            "this chat template renders a session's images differently in its first turn: start the "
                            "session with sequence_start", param="messages")
        else:
            raise InvalidRequestError("give a prompt, messages or input_ids", param="prompt")
        if len(ids) >= self.session_len:  # named after the request's field: chat messages or a text prompt
            raise PromptTooLongError(len(ids), self.session_len, "messages" if req.messages is not None else "prompt")
        return TokenizedReq(rid=req.rid, reply_to=req.reply_to, token_ids=ids, params=self.resolve(req.params),
                            session_id=req.session_id, first_turn_ids=first_turn_ids, priority=req.priority,
                            images=images)

    def _prepare_images(self, prompt: Prompt) -> list:
        """The prompt's images fetched, decoded and processed for the vision encoder (none for a
        prompt without image parts); a text model refuses them."""
        sources = image_sources(prompt)
        if not sources:
            return []
        self._check_takes_images()
        return self.image_prompt.prepare(load_images(sources, self.image_limits))

    def _check_takes_images(self) -> None:
        if self.image_prompt is None:
            raise InvalidRequestError(
                f"{self.model_path.name} is a text model and takes no images: send text parts only, or serve a "
                "vision-language model (conveyor list)", param="messages")
