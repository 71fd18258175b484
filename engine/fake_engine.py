"""An engine without a model: every running request gets one token per step, as fast as possible.

For measuring the service stack (tokenizer, ZeroMQ hops, detokenizer, HTTP) without a GPU,
and for fast stack tests. It validates requests like LLMEngine and keeps its block accounting
(one block per request) so leak checks mean the same thing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conveyor.engine.errors import InvalidRequestError, PromptTooLongError
from conveyor.engine.llm_engine import StepOutput, validate_params
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import FinishReason


@dataclass
class _Req:
    seq_id: int
    params: SamplingParams
    num_prompt: int
    generated: int = 0
    session_id: int | None = None


class _Blocks:
    """Just enough of BlockManager for stats and leak checks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.prefix_hit_tokens = self.prefix_query_tokens = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class FakeEngine:
    """Drop-in for LLMEngine in the engine service; emits ``vocab_cycle`` tokens round-robin."""

    def __init__(self, vocab_cycle: list[int], session_len: int = 8192, max_batch_size: int = 1024,
                 num_blocks: int = 65_536, step_delay: float = 0.0):
        self.vocab_cycle = vocab_cycle or [1]
        self.session_len = session_len
        self.max_batch_size = max_batch_size
        self.step_delay = step_delay
        self.block_manager = _Blocks(num_blocks)
        self.device, self.dtype = "fake", "none"
        self._running: dict[int, _Req] = {}
        self._waiting: list[_Req] = []
        self._pending: list[StepOutput] = []
        self.tokens_emitted = 0
        self.busy_seconds = 0.0

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._pending)

    def add_request(self, token_ids: list[int], params: SamplingParams, seq_id: int | None = None,
                    session_id: int | None = None):
        validate_params(params)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        if len(token_ids) >= self.session_len:
            raise PromptTooLongError(len(token_ids), self.session_len)
        self._waiting.append(_Req(seq_id, params, len(token_ids), session_id=session_id))
        return None

    def _finish(self, seq_id: int, reason: FinishReason) -> None:
        req = self._running.pop(seq_id, None)
        if req is None:
            for i, w in enumerate(self._waiting):
                if w.seq_id == seq_id:
                    req = self._waiting.pop(i)
                    break
            else:
                return
        else:
            self.block_manager.num_free_blocks += 1
        self._pending.append(StepOutput(seq_id, [], True, reason))

    def abort(self, seq_id: int) -> None:
        self._finish(seq_id, FinishReason.ABORT)

    def stop(self, seq_id: int) -> None:
        self._finish(seq_id, FinishReason.STOP)

    def end_session(self, session_id: int) -> None:
        """Sessions keep no state here."""

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        while self._waiting and len(self._running) < self.max_batch_size:
            req = self._waiting.pop(0)
            self._running[req.seq_id] = req
            self.block_manager.num_free_blocks -= 1
        cycle = self.vocab_cycle
        for seq_id, req in list(self._running.items()):
            token = cycle[(req.generated + seq_id) % len(cycle)]
            req.generated += 1
            done = req.generated >= req.params.max_new_tokens or req.num_prompt + req.generated >= self.session_len
            if done:
                del self._running[seq_id]
                self.block_manager.num_free_blocks += 1
            outputs.append(StepOutput(seq_id, [token], done, FinishReason.LENGTH if done else None))
        self.tokens_emitted += sum(1 for o in outputs if o.token_ids)
        if self.step_delay:
            time.sleep(self.step_delay)
        self.busy_seconds += time.perf_counter() - start
        return outputs

    def stats(self) -> dict[str, float]:
        return {"running": len(self._running), "waiting": len(self._waiting),
                "kv_usage": self.block_manager.usage, "prefix_query_tokens": 0, "prefix_hit_tokens": 0,
                "generated_tokens": self.tokens_emitted, "busy_seconds": self.busy_seconds}
