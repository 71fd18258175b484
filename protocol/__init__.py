"""The wire: message structs, sampling parameters, typed errors, socket addresses, the codec.

Depends on msgspec and pyzmq only.
"""

from .addresses import Addresses, Endpoint
from .codec import Codec
from .errors import (
    AdapterError,
    ConveyorError,
    EngineConfigError,
    InvalidRequestError,
    PromptTooLongError,
    SessionBusyError,
    UnknownAdapterError,
    UnsupportedModelError,
    error_code,
    rebuild_error,
)
from .messages import (
    FINISH_REASONS,
    Abort,
    AdapterDone,
    Admitted,
    CancelSession,
    DetokenizerIn,
    EngineIn,
    EngineStats,
    ErrorOut,
    Finish,
    GenerateReq,
    IngressGone,
    IngressIn,
    LauncherIn,
    LoadAdapter,
    LoadReport,
    Ping,
    Ready,
    SessionEnd,
    Stage,
    StageStatus,
    StopReq,
    TextBatch,
    TokenBatch,
    TokenizedReq,
    TokenizerIn,
    UnloadAdapter,
)
from .sampling import DetokenizeParams, SamplingParams, validate
from .security import CurveKeys, SecurityError

__all__ = [
    "FINISH_REASONS", "Abort", "AdapterDone", "AdapterError", "Addresses", "Admitted", "CancelSession", "Codec",
    "ConveyorError", "CurveKeys", "DetokenizeParams", "DetokenizerIn", "EngineConfigError", "EngineIn", "EngineStats",
    "Endpoint", "ErrorOut", "Finish", "GenerateReq", "IngressGone", "IngressIn", "InvalidRequestError", "LauncherIn",
    "LoadAdapter", "LoadReport", "Ping", "PromptTooLongError", "Ready", "SamplingParams", "SecurityError",
    "SessionBusyError", "SessionEnd", "Stage", "StageStatus", "StopReq", "TextBatch", "TokenBatch", "TokenizedReq",
    "TokenizerIn", "UnknownAdapterError", "UnloadAdapter", "UnsupportedModelError", "error_code", "rebuild_error",
    "validate",
]
