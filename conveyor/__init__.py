"""conveyor: serve large language models. LMDeploy's offline API under the same names."""

from conveyor.engine.config import EngineConfig, PytorchEngineConfig, TurbomindEngineConfig
from conveyor.errors import (
    ConveyorError,
    EngineConfigError,
    EngineDiedError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownChatTemplateError,
    UnsupportedModelError,
)
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
