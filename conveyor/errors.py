"""Every typed error conveyor raises, in one import."""

from conveyor.protocol.errors import (
    ConveyorError,
    EngineConfigError,
    InvalidRequestError,
    PromptTooLongError,
    SessionBusyError,
    UnsupportedModelError,
)
from conveyor.services.local_stack import EngineDiedError
from conveyor.services.tokenizer.chat_template import UnknownChatTemplateError

__all__ = [
    "ConveyorError", "EngineConfigError", "EngineDiedError", "InvalidRequestError",
    "PromptTooLongError", "SessionBusyError", "UnknownChatTemplateError", "UnsupportedModelError",
]
