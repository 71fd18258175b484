"""A request inside the engine: token ids plus two counters (computed, known)."""

from __future__ import annotations

import itertools
import time
from enum import IntEnum
from typing import TYPE_CHECKING

from ..protocol.messages import Finish
from ..protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from ..protocol.multimodal import ImageInput
    from .grammar import GuideState


class SequenceStatus(IntEnum):
    """Where a sequence is in the scheduler's queues."""

    WAITING = 0  # has tokens whose KV is not computed and no place in the running batch
    RUNNING = 1  # in the running batch, holds blocks
    PARKED = 2  # a session between turns: holds its blocks, schedules nothing
    FINISHED = 3


_ids = itertools.count()


class Sequence:
    """One generation stream.

    There are no prefill or decode phases: ``num_computed_tokens`` of ``token_ids`` have their
    KV in the cache, the rest are still to be computed (the whole prompt at first, one sampled
    token later, the new turn's prompt for a session, everything again after preemption).

    ``token_ids`` holds only ids known on the host. With overlapped steps
    (``engine/llm_engine.py``) a token can be sampled on the device and not yet read back: the
    scheduler counts it in ``num_pending_tokens`` (at most two: the step being read back and the
    one just launched), so it counts among ``num_tokens`` and the next step can be scheduled; the
    model runner feeds it to the model from the launching step's ids, on the device.
    """

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: int | None = None,
        seq_id: int | None = None,
    ):
        self.seq_id = next(_ids) if seq_id is None else seq_id  # the block manager's key
        self.request_id = f"seq-{self.seq_id}" if request_id is None else request_id
        self.session_id = session_id
        self.token_ids = list(token_ids)
        self.num_pending_tokens = 0  # sampled on the device, not read back (scheduler and runner only)
        self.num_history_tokens = 0  # a session's tokens before this turn
        self.params = params
        self.num_prompt_tokens = len(token_ids)  # of the current turn's request, history included
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.block_table: list[int] = []  # the block of each block_size tokens, in order
        # Leading entries of ``block_table`` (after a kept head block, ``BlockManager``) whose blocks
        # left the attention window of every layer and went back to the block manager; they name
        # a block the sequence still holds, so the table keeps one entry per position.
        self.num_released_blocks = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: Finish | None = None
        self.arrival_time = time.monotonic()
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.sampling_seed = 0  # seeds the sampler's noise (the request's seed or a random one)
        self.priority = 0  # the current turn's: a lower value is admitted first (QoS user groups)
        # The fewest tokens its first chunk brings (the cache layout's ``min_first_chunk_tokens``,
        # capped by its length and the step budget; 0 before its first admission). Fixed then, so
        # that a recompute after preemption or eviction derives the same per-sequence cache state
        # from the same leading tokens (``KVCacheLayout``).
        self.first_chunk_tokens = 0
        # The turn's place in its output constraint (``engine/grammar.py``), if it has one.
        self.guide_state: GuideState | None = None
        # Images of every turn, their spans in ``token_ids`` (``engine/multimodal.py``): kept with
        # the history, since a recompute after preemption runs the encoder again.
        self.images: list[ImageInput] = []
        # The LoRA adapter the current turn runs with (``engine/lora/``; an id, never reused), 0 for
        # the base model alone. Its KV is computed with it, so its prefix-cache keys include it.
        self.adapter_id = 0

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence: prompt plus generated, pending ones included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated in the current turn, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The current turn's generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def turn_token_ids(self) -> list[int]:
        """The current turn's prompt (after a session's history)."""
        return self.token_ids[self.num_history_tokens : self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is still to be computed."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def admissible(self) -> bool:
        """Whether the scheduler may start it: not while its grammar compiles (nor after the
        compile failed: the engine ends it)."""
        return self.guide_state is None or (self.guide_state.ready and self.guide_state.error is None)

    @property
    def is_finished(self) -> bool:
        """True once generation for this turn has ended."""
        return self.status == SequenceStatus.FINISHED

    def start_turn(self, new_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> None:
        """Begin another turn of a session: the history stays, new prompt tokens are appended.
        The turn has its own ``request_id``, so that a token of the last turn still on the
        device is never taken for one of this turn."""
        self.request_id = f"seq-{self.seq_id}.{next(_ids)}" if request_id is None else request_id
        self.num_history_tokens = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason = None
        self.arrival_time = time.monotonic()
        self.logprobs, self.top_logprobs = [], []
        self.guide_state = None
