"""An engine without a model: every running request gets one token per step, as fast as possible.

For measuring the service stack (tokenizer, ZeroMQ hops, detokenizer, HTTP) without a GPU, and
for fast stack tests: ``python -m conveyor.testing.serve api_server MODEL`` serves the real stages
around it (``build`` is that entry's default ``--engine-factory``).
It implements ``conveyor.engine.interface.Engine``, validates requests like ``LLMEngine`` and
keeps a block count (one block per running request) so that leak checks mean the same thing.
LoRA adapters are only names and paths here (a path must be a directory with an
``adapter_config.json``); a request's adapter shifts where its tokens start in the cycle, so a
test can tell which adapter a request ran with.
``CONVEYOR_FAKE_STEP_DELAY`` (seconds) slows each step, for tests that need requests in flight.
"""

from __future__ import annotations

import itertools
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .. import envs
from ..engine.config import EngineConfig
from ..engine.llm_engine import StepOutput
from ..protocol import (AdapterError, EngineConfigError, EngineStats, Finish, InvalidRequestError, PromptTooLongError,
                        SamplingParams, UnknownAdapterError, validate)
from ..protocol.multimodal import ImageInput

FILLER = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "


@dataclass
class _Req:
    request_id: str
    params: SamplingParams
    num_prompt: int
    turn_token_ids: list[int]
    num_history_tokens: int = 0
    generated: int = 0
    priority: int = 0
    shift: int = 0  # where in the token cycle its output starts (its adapter's)


class FakeEngine:
    """Emits ``vocab_cycle`` tokens round-robin; sessions keep only their token counts."""

    def __init__(self, vocab_cycle: list[int], session_len: int = 8192, max_batch_size: int = 1024,
                 num_blocks: int = 65_536, step_delay: float = 0.0, adapters: dict[str, str] | None = None,
                 lora: bool = False):
        self.vocab_cycle = vocab_cycle or [1]
        self.session_len = session_len
        self.max_batch_size = max_batch_size
        self.num_blocks = self.free_blocks = num_blocks
        self.step_delay = step_delay
        self._running: dict[str, _Req] = {}
        self._waiting: dict[str, _Req] = {}
        self._pending: list[StepOutput] = []
        self._sessions: dict[int, tuple[int, str | None]] = {}  # id -> (tokens, running request)
        self._ids = itertools.count()
        self.tokens_emitted = 0
        self._prioritized = False  # a request had a priority: admission looks for the lowest value
        self.lora = lora or bool(adapters)  # as EngineConfig.lora_enabled: adapters given, or a pool sized
        self.adapters: dict[str, str] = {}  # name -> path, in load order
        for name, path in (adapters or {}).items():
            self.load_adapter(name, path)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._pending)

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    session_id: int | None = None, first_turn_ids: list[int] | None = None, priority: int = 0,
                    images: list[ImageInput] | None = None) -> _Req:
        validate(params)
        if images:
            raise InvalidRequestError("the fake engine has no vision encoder: it takes no images", param="messages")
        history, running = self._sessions.get(session_id, (0, None)) if session_id is not None else (0, None)
        if running is not None:
            raise InvalidRequestError(f"session {session_id} is still generating: wait for it or abort it",
                                      param="session_id")
        if first_turn_ids is not None and not history:
            token_ids = first_turn_ids
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        adapter = params.adapter_name
        if adapter is not None and adapter not in self.adapters:
            raise UnknownAdapterError(adapter, list(self.adapters))
        if history + len(token_ids) >= self.session_len:
            raise PromptTooLongError(history + len(token_ids), self.session_len)
        rid = f"fake-{next(self._ids)}" if request_id is None else request_id
        req = _Req(rid, params, history + len(token_ids), list(token_ids), history, priority=priority,
                   shift=adapter_shift(adapter, len(self.vocab_cycle)))
        self._prioritized = self._prioritized or priority != 0
        self._waiting[rid] = req
        if session_id is not None:
            self._sessions[session_id] = (history, rid)
        return req

    def _end(self, req: _Req, reason: Finish, token: int | None = None) -> StepOutput:
        for sid, (_, rid) in self._sessions.items():
            if rid == req.request_id:
                self._sessions[sid] = (req.num_prompt + req.generated, None)
                break
        return StepOutput(req.request_id, token, reason)

    def _finish(self, request_id: str, reason: Finish) -> None:
        req = self._running.pop(request_id, None)
        if req is not None:
            self.free_blocks += 1
        else:
            req = self._waiting.pop(request_id, None)
        if req is not None:
            self._pending.append(self._end(req, reason))

    def abort(self, request_id: str) -> None:
        self._finish(request_id, Finish.ABORT)

    def stop(self, request_id: str) -> None:
        self._finish(request_id, Finish.STOP)

    def abort_session(self, session_id: int) -> None:
        rid = self._sessions.get(session_id, (0, None))[1]
        if rid is not None:
            self.abort(rid)

    def end_session(self, session_id: int) -> None:
        self.abort_session(session_id)
        self._sessions.pop(session_id, None)

    def release_idle_sessions(self) -> int:
        """Nothing to release: a session here holds no blocks between turns (only its token count,
        which is its history and must stay), so an idle one costs no cache."""
        return 0

    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        while self._waiting and len(self._running) < self.max_batch_size:
            rid = next(iter(self._waiting)) if not self._prioritized else \
                min(self._waiting, key=lambda r: self._waiting[r].priority)  # the first of the lowest
            self._running[rid] = self._waiting.pop(rid)
            self.free_blocks -= 1
        cycle = self.vocab_cycle
        for i, (rid, req) in enumerate(list(self._running.items())):
            token = cycle[(req.generated + i + req.shift) % len(cycle)]
            req.generated += 1
            if req.generated >= req.params.max_new_tokens or req.num_prompt + req.generated >= self.session_len:
                del self._running[rid]
                self.free_blocks += 1
                outputs.append(self._end(req, Finish.LENGTH, token))
            else:
                outputs.append(StepOutput(rid, token))
        self.tokens_emitted += sum(1 for o in outputs if o.token is not None)
        if self.step_delay:
            time.sleep(self.step_delay)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), waiting=len(self._waiting),
                           kv_usage=1.0 - self.free_blocks / self.num_blocks, num_blocks=self.num_blocks,
                           free_blocks=self.free_blocks, generated_tokens=self.tokens_emitted,
                           adapters=list(self.adapters))

    def load_adapter(self, name: str, path: str) -> None:
        """Register ``name`` -> ``path``; the checkpoint is only looked for (no weights are read)."""
        if not self.lora:
            raise EngineConfigError("this engine has no LoRA adapter pool: start it with adapters or max_loras "
                                    "(--adapters name=path, --max-loras N) to load adapters at run time")
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded: unload it first or pick "
                                      "another name", param="lora_name")
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"{path!r} is not a PEFT LoRA checkpoint (no adapter_config.json in it): give the "
                               "directory a PEFT save_pretrained wrote")
        self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        """Forget ``name`` (its running requests keep their tokens' shift)."""
        if self.adapters.pop(name, None) is None:
            raise UnknownAdapterError(name, list(self.adapters), param="lora_name")

    def adapter_names(self) -> list[str]:
        return list(self.adapters)


def adapter_shift(adapter: str | None, cycle_len: int) -> int:
    """Where an adapter's requests start in the token cycle: 0 for the base model, else fixed by its name."""
    return 0 if adapter is None else 1 + zlib.crc32(adapter.encode()) % max(cycle_len - 1, 1)


def build(model_path: str, config: EngineConfig) -> FakeEngine:
    """The engine factory ``conveyor.testing.serve`` starts by default: cycles through the tokens of a filler text."""
    from ..services.tokenizer.preprocess import load_tokenizer

    ids = load_tokenizer(model_path).encode(FILLER * 4, add_special_tokens=False)
    return FakeEngine(ids, session_len=config.session_len or 8192, max_batch_size=config.max_batch_size,
                      step_delay=envs.fake_step_delay(), adapters=config.adapters, lora=config.lora_enabled)
