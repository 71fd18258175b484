"""The engine stage's handler on the real engine, without threads or sockets: messages go into
``EngineService.handle`` as the input thread would hand them over, steps run on the test's
thread, and everything the stage would send comes out as a list.

The engine is the real ``LLMEngine`` on a tiny dummy-weight Llama on the CPU (``tiny_llama.TINY``
shapes, vocabulary 128), with a short ``session_len`` so that every request ends in a few steps.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import msgspec
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol import (
    Addresses,
    Admitted,
    Codec,
    EngineIn,
    ErrorOut,
    Finish,
    TokenBatch,
)
from conveyor.services.engine.service import EngineService, to_token_batch
from tiny_llama import TINY

VOCAB = TINY["vocab_size"]
REPLY = "inproc://conveyor-reply-test"


def tiny_engine(model_dir: Path, **overrides) -> LLMEngine:
    """The real engine on dummy weights (seeded: every engine built this way computes alike)."""
    (model_dir / "config.json").write_text(json.dumps(TINY))
    cfg = dict(load_format="dummy", device="cpu", cache_max_entry_count=48, block_size=4, max_batch_size=8,
               max_prefill_token_num=64, session_len=40)
    return LLMEngine(model_dir, EngineConfig(**{**cfg, **overrides}))


class EngineStage:
    """An EngineService around ``engine``, driven by hand."""

    MAX_STEPS = 2_000  # far more than any test needs: a hang fails instead of spinning

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.service = EngineService(engine, None, Addresses.inproc())
        self.codec = Codec(EngineIn)
        self.sent: list = []  # every message the stage put on its output socket

    def wire(self, msg: msgspec.Struct):
        """``msg`` as the engine's input thread decodes it from a frame (wire types, not Python's)."""
        return self.codec.decode(self.codec.encode(msg))

    def handle(self, msgs: list) -> list:
        """Apply ``msgs`` (after a trip through the codec) and return what the stage sent."""
        self.service.handle([self.wire(m) for m in msgs])
        return self._drain()

    def step(self, n: int = 1) -> list:
        """Run up to ``n`` engine steps, as the service loop does; return what the stage sent."""
        for _ in range(n):
            if not self.engine.has_work:
                break
            outputs = self.engine.step()
            if outputs:
                self.service._outbox.put(to_token_batch(outputs))
        return self._drain()

    def run(self) -> list:
        """Step until the engine is idle."""
        out = self.step(self.MAX_STEPS)
        assert not self.engine.has_work, "the engine did not finish its requests"
        return out

    def _drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self.service._outbox.get_nowait())
            except queue.Empty:
                self.sent += out
                return out

    # ---- reading what was sent ---------------------------------------------------------------
    def errors(self) -> dict[str, ErrorOut]:
        """The refusals sent so far, by request id."""
        return {m.rid: m for m in self.sent if isinstance(m, ErrorOut)}

    def admitted(self) -> set[str]:
        """The request ids admitted so far."""
        return {m.rid for m in self.sent if isinstance(m, Admitted)}

    def tokens(self, rid: str) -> list[int]:
        """Request ``rid``'s generated tokens, in order."""
        return [t for m in self.sent if isinstance(m, TokenBatch) for r, t in zip(m.rids, m.tokens)
                if r == rid and t >= 0]

    def finish(self, rid: str) -> Finish | None:
        """How request ``rid`` ended (None while it runs)."""
        for m in self.sent:
            if isinstance(m, TokenBatch):
                for r, f in zip(m.rids, m.finish):
                    if r == rid and f >= 0:
                        return Finish(f)
        return None

    def assert_idle_and_empty(self) -> None:
        """No request, session or KV block is left behind."""
        bm = self.engine.block_manager
        assert not self.engine.has_work and not self.engine._seqs and not self.engine._sessions
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
