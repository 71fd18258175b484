"""Typed errors. Each message says what was wrong and how to fix it."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class InvalidRequestError(ConveyorError, ValueError):
    """A request's input or parameters are invalid (OpenAI type: invalid_request_error)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus history) does not fit in session_len."""

    def __init__(self, num_tokens: int, limit: int):
        super().__init__(
            f"the prompt is {num_tokens} tokens but session_len is {limit}: shorten the prompt, "
            "or raise session_len in the engine config",
            param="messages",
        )
        self.num_tokens, self.limit = num_tokens, limit


class UnsupportedModelError(ConveyorError, ValueError):
    """The checkpoint's architecture or format is not one conveyor can run."""


class EngineConfigError(ConveyorError, ValueError):
    """An engine setting is invalid or cannot be met on this machine."""
