"""conveyor: serve large language models. LMDeploy's offline API under the same names."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

# Names load on first use (PEP 562): `from conveyor.api_client import APIClient` (a thin HTTP
# client) must not pay for torch and the engine, which the names below pull in.
_EXPORTS = {
    "EngineConfig": "conveyor.engine.config", "PytorchEngineConfig": "conveyor.engine.config",
    "TurbomindEngineConfig": "conveyor.engine.config",
    "ConveyorError": "conveyor.errors", "EngineConfigError": "conveyor.errors", "EngineDiedError": "conveyor.errors",
    "InvalidRequestError": "conveyor.errors", "PromptTooLongError": "conveyor.errors",
    "UnknownChatTemplateError": "conveyor.errors", "UnsupportedModelError": "conveyor.errors",
    "GenerationConfig": "conveyor.messages", "Response": "conveyor.messages",
    "Pipeline": "conveyor.pipeline", "Session": "conveyor.pipeline", "pipeline": "conveyor.pipeline",
    "client": "conveyor.serving", "serve": "conveyor.serving",
    "ChatTemplateConfig": "conveyor.services.tokenizer.chat_template",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Importing the submodule ``conveyor.pipeline`` sets the package's attribute ``pipeline``
    to that module; the package's ``pipeline`` stays the function, as an eager import left it."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from conveyor.engine.config import EngineConfig, PytorchEngineConfig, TurbomindEngineConfig
    from conveyor.errors import (ConveyorError, EngineConfigError, EngineDiedError, InvalidRequestError,
                                 PromptTooLongError, UnknownChatTemplateError, UnsupportedModelError)
    from conveyor.messages import GenerationConfig, Response
    from conveyor.pipeline import Pipeline, Session, pipeline
    from conveyor.serving import client, serve
    from conveyor.services.tokenizer.chat_template import ChatTemplateConfig

__version__ = "0.1.0"

__all__ = [
    "ChatTemplateConfig", "ConveyorError", "EngineConfig", "EngineConfigError", "EngineDiedError",
    "GenerationConfig", "InvalidRequestError", "Pipeline", "PromptTooLongError",
    "PytorchEngineConfig", "Response", "Session", "TurbomindEngineConfig",
    "UnknownChatTemplateError", "UnsupportedModelError", "client", "pipeline", "serve",
]
