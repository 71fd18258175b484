"""What the engine service needs from an engine: ``LLMEngine`` implements it, and so does the
model-free engine of the tests and the stack benchmark (``conveyor/testing/fake_engine.py``)."""

from __future__ import annotations

from typing import Protocol

from ..protocol.messages import EngineStats, Finish
from ..protocol.multimodal import ImageInput
from ..protocol.sampling import SamplingParams


class AdmittedRequest(Protocol):
    """What ``add_request`` tells about the request it took."""

    request_id: str
    num_history_tokens: int  # a session's tokens before this turn
    turn_token_ids: list[int]  # this turn's prompt, as the engine took it (first-turn rendering or not)


class Output(Protocol):
    """What one step did to one request (``llm_engine.StepOutput``)."""

    request_id: str
    token: int | None
    finish_reason: Finish | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    num_cached_tokens: int


class Engine(Protocol):
    """Requests in, one list of outputs per step; not thread-safe (one thread drives it)."""

    session_len: int

    @property
    def has_work(self) -> bool:
        """True while a step would do or report something."""

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    session_id: int | None = None, first_turn_ids: list[int] | None = None, priority: int = 0,
                    images: list[ImageInput] | None = None) -> AdmittedRequest:
        """Queue a request or a session's next turn; raises a ConveyorError on bad input
        (UnknownAdapterError for a ``params.adapter_name`` not loaded). Waiting requests of a lower
        ``priority`` start first."""

    def abort(self, request_id: str) -> None:
        """End a request now (reported with Finish.ABORT by the next step)."""

    def stop(self, request_id: str) -> None:
        """End a request whose text reached a stop string (Finish.STOP)."""

    def abort_session(self, session_id: int) -> None:
        """Abort a session's running turn; its history stays."""

    def end_session(self, session_id: int) -> None:
        """Abort a session's running turn and forget the session."""

    def release_idle_sessions(self) -> int:
        """Free the KV blocks of sessions idle between turns past the configured timeout (their
        history stays, recomputed by a next turn); returns how many. Called about once a second."""

    def step(self) -> list[Output]:
        """Run one step; every request that got a token or ended appears once."""

    def stats(self) -> EngineStats:
        """Queues, cache usage and counters (and the LoRA adapters loaded)."""

    def load_adapter(self, name: str, path: str) -> None:
        """Read a PEFT LoRA checkpoint and register it under ``name``. Raises EngineConfigError when
        the engine has no LoRA pool (started without adapters or max_loras), InvalidRequestError
        when the name is taken, AdapterError for a bad checkpoint (missing file, wrong base shape,
        rank over max_lora_rank)."""

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter (requests already running with it finish with it). Raises UnknownAdapterError."""

    def adapter_names(self) -> list[str]:
        """Registered adapters, in load order."""
