"""The wire: message structs, socket addresses, and the codec. Depends on msgspec and pyzmq only."""

from conveyor.protocol.addresses import Addresses, Endpoint
from conveyor.protocol.codec import Codec
from conveyor.protocol.messages import (
    Abort,
    DetokenizerIn,
    DetokSpec,
    EngineIn,
    EngineParams,
    ErrorOut,
    Finish,
    GenerateReq,
    IngressIn,
    LauncherIn,
    LoadReport,
    NewRequest,
    Ping,
    Ready,
    SamplingOptions,
    SessionEnd,
    Stage,
    StopReq,
    TextBatch,
    TokenBatch,
    TokenizedReq,
    TokenizerIn,
)

__all__ = [
    "Abort", "Addresses", "Codec", "DetokSpec", "DetokenizerIn", "EngineIn", "EngineParams", "Endpoint",
    "ErrorOut", "Finish", "GenerateReq", "IngressIn", "LauncherIn", "LoadReport", "NewRequest", "Ping",
    "Ready", "SamplingOptions", "SessionEnd", "Stage", "StopReq", "TextBatch", "TokenBatch",
    "TokenizedReq", "TokenizerIn",
]
