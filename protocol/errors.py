"""Typed errors. Each message says what was wrong and how to fix it."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class InvalidRequestError(ConveyorError, ValueError):
    """A request's input or parameters are invalid (OpenAI type: invalid_request_error)."""

    code: str | None = None  # OpenAI's machine-readable error code, where one applies

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus history) does not fit in session_len."""

    code = "context_length_exceeded"  # OpenAI's code for it

    def __init__(self, num_tokens: int, limit: int, param: str = "messages"):
        # param: the request field holding the prompt ("messages" for chat, "prompt" for text)
        super().__init__(
            f"the prompt is {num_tokens} tokens but session_len is {limit}: shorten the prompt, "
            "or raise session_len in the engine config",
            param=param,
        )
        self.num_tokens, self.limit = num_tokens, limit


class SessionBusyError(InvalidRequestError):
    """A session's next turn arrived while its previous one still runs (wait, or cancel it)."""

    code = "session_busy"

    def __init__(self, session_id: int):
        super().__init__(f"session {session_id} is still generating: wait for it or abort it",
                         param="session_id")


class UnknownAdapterError(InvalidRequestError):
    """A request named a LoRA adapter (or a served model) that is not loaded."""

    code = "model_not_found"  # OpenAI's code for a model name it does not serve

    def __init__(self, name: str, loaded: list[str] | tuple[str, ...] = (), param: str = "adapter_name"):
        listed = ", ".join(repr(n) for n in loaded) if loaded else "none"
        super().__init__(f"no LoRA adapter named {name!r} is loaded (loaded: {listed}): load it first "
                         "(adapters={name: path}, --adapters name=path, or POST /v1/load_lora_adapter)",
                         param=param)


class AdapterError(ConveyorError, ValueError):
    """A LoRA adapter cannot be loaded: a missing or malformed PEFT checkpoint, a module or shape
    the base model does not have, a rank over the pool's limit."""


class UnsupportedModelError(ConveyorError, ValueError):
    """The checkpoint's architecture or format is not one conveyor can run."""


class EngineConfigError(ConveyorError, ValueError):
    """An engine setting is invalid or cannot be met on this machine."""


def error_code(exc: BaseException) -> str | None:
    """The OpenAI error code of an exception (None for most)."""
    return getattr(exc, "code", None)


def rebuild_error(message: str, param: str | None, code: str | None) -> InvalidRequestError:
    """The typed exception for an error that came back over the wire."""
    if code == PromptTooLongError.code:
        exc = PromptTooLongError.__new__(PromptTooLongError)
        InvalidRequestError.__init__(exc, message, param)
        exc.num_tokens = exc.limit = None
        return exc
    if code == UnknownAdapterError.code:
        exc = UnknownAdapterError.__new__(UnknownAdapterError)
        InvalidRequestError.__init__(exc, message, param)
        return exc
    if code == SessionBusyError.code:
        exc = SessionBusyError.__new__(SessionBusyError)
        InvalidRequestError.__init__(exc, message, param)
        return exc
    return InvalidRequestError(message, param)
