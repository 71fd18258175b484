"""Every typed error conveyor raises, in one import."""

from conveyor.engine.errors import (
    ConveyorError,
    EngineConfigError,
    InvalidRequestError,
    PromptTooLongError,
    UnsupportedModelError,
)
from conveyor.local_stack import EngineDiedError
from conveyor.services.chat_template import UnknownChatTemplateError

__all__ = [
    "ConveyorError", "EngineConfigError", "EngineDiedError", "InvalidRequestError",
    "PromptTooLongError", "UnknownChatTemplateError", "UnsupportedModelError",
]
