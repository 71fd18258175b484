"""A request inside the engine: token ids plus two counters (computed, known)."""

from __future__ import annotations

import itertools
import time
from enum import IntEnum

from conveyor.engine.sampling_params import SamplingParams


class SequenceStatus(IntEnum):
    """Where a sequence is in the scheduler's queues."""

    WAITING = 0  # has tokens whose KV is not computed and no place in the running batch
    RUNNING = 1  # in the running batch, holds blocks
    PARKED = 2  # a session between turns: holds its blocks, schedules nothing
    FINISHED = 3


class FinishReason(IntEnum):
    """Why generation ended; maps to OpenAI's finish_reason strings."""

    STOP = 0  # a stop token or stop string
    LENGTH = 1  # max_new_tokens or session_len
    ABORT = 2  # the client went away or asked to stop

    @property
    def openai(self) -> str:
        """The OpenAI / LMDeploy spelling."""
        return ("stop", "length", "abort")[self]


_ids = itertools.count()


class Sequence:
    """One generation stream.

    There are no prefill or decode phases: ``num_computed_tokens`` of ``token_ids`` have their
    KV in the cache, the rest are still to be computed (the whole prompt at first, one sampled
    token later, the new turn's prompt for a session, everything again after preemption).

    With overlapped steps (``engine/llm_engine.py``) a token can be sampled on the GPU but not yet
    read back: it is held as a *placeholder*, a negative id ``-1 - row`` naming its row in the
    launching step's sampled-ids tensor, so the next step can feed it to the model on the device.
    Placeholders only ever sit at the tail of ``token_ids`` (at most two: the step being read back
    and the one just launched) and are replaced by the real ids when the step is read back.
    """

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        seq_id: int | None = None,
        session_id: int | None = None,
    ):
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.session_id = session_id
        self.token_ids = list(token_ids)
        self.params = params
        self.num_prompt_tokens = len(token_ids)  # of the current turn's request, history included
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic()
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        # Its last (placeholder) token ends the turn by count (max_new_tokens / session_len): the
        # scheduler gives it no more steps; the read-back finishes it.
        self.final_token_pending = False
        self.sampling_seed = 0  # seeds the sampler's noise (the request's seed or a random one)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus generated."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated in the current turn."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The current turn's generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is still to be computed."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once generation for this turn has ended."""
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record a sampled token (its KV is computed in the next step)."""
        self.token_ids.append(token_id)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (all but trailing placeholders)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] < 0:
            n -= 1
        return n

    def drop_unresolved(self) -> None:
        """Forget trailing placeholders (the turn ended before they were read back) and count the
        last known token's KV as not computed, the state a finished turn has without overlap."""
        known = self.num_known_tokens
        if known < len(self.token_ids):
            del self.token_ids[known:]
        self.num_computed_tokens = min(self.num_computed_tokens, max(known - 1, 0))

    def start_turn(self, new_token_ids: list[int], params: SamplingParams) -> None:
        """Begin another turn of a session: the history stays, new prompt tokens are appended."""
        self.token_ids.extend(new_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason = None
        self.final_token_pending = False
        self.arrival_time = time.monotonic()
        self.logprobs, self.top_logprobs = [], []
