"""Continuous batching under a token budget, with chunked prefill, preemption and sessions.

Each step gives every sequence some of its uncomputed tokens, within ``max_num_tokens`` in
all: running sequences first (a decode is one token, an unfinished prompt its next chunk), then
waiting ones while there is room in the batch. So a long prompt is cut into chunks and never
stalls the decodes running beside it. When the cache runs out, a parked session is evicted
first, then the most recently admitted running sequence is preempted and later recomputed. A
parked session left idle too long is evicted the same way (``release_idle``), so that sessions
nobody continues do not hold the cache forever.

Waiting sequences are admitted in ``Sequence.priority`` order (lower first; equals first come,
first served), kept sorted as they are queued so that a step never sorts; a running sequence is
never withdrawn for a better one, but when the cache runs short the worst-priority one is
preempted first (docs/architecture.md, "QoS").

A step has two halves, so that the engine can overlap them with the GPU (``engine/llm_engine.py``):
``launched`` right after the step is handed to the GPU advances the counters and counts each
sampling sequence's new token as pending (``Sequence.num_pending_tokens``); ``resolve`` later
appends the real token and decides whether the turn ended. Everything that depends only on counts
(the next step's shape, ``max_new_tokens``, ``session_len``) is known at launch; only stop tokens
need the ids. ``update`` does both at once.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from .block_manager import BlockManager, PrefixMatch
from .multimodal import whole_image_chunk
from ..protocol.messages import Finish
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What runs in one step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the flattened batch."""
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Owns the queues; asks the block manager for room; applies each step's sampled tokens."""

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_tokens: int, session_len: int,
                 clock: Callable[[], float] = time.monotonic, min_first_chunk_tokens: int = 0,
                 max_adapters: int = 0):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        # The cache layout's answer (``KVCacheLayout.min_first_chunk_tokens``): every first chunk
        # brings at least this many tokens, or the whole sequence or budget when shorter
        # (``Sequence.first_chunk_tokens``). 0: no such rule.
        self.min_first_chunk_tokens = min_first_chunk_tokens
        self.session_len = session_len
        # LoRA: the most distinct adapters the running batch may hold (the device pool's slots);
        # 0: no limit (no adapters). A waiting sequence of another adapter waits while it is full.
        self.max_adapters = max_adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: OrderedDict[int, Sequence] = OrderedDict()  # session id -> seq, LRU first
        self.parked_at: dict[int, float] = {}  # session id -> clock() when it parked
        self.clock = clock  # monotonic seconds; a test passes its own

    @property
    def has_work(self) -> bool:
        """True while some sequence wants a step."""
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (or a session's next turn)."""
        if seq.session_id is not None:  # its blocks now belong to a live turn
            self.parked.pop(seq.session_id, None)
            self.parked_at.pop(seq.session_id, None)
        seq.status = SequenceStatus.WAITING
        self._queue(seq)

    def _queue(self, seq: Sequence, ahead_of_equals: bool = False) -> None:
        """Put ``seq`` into ``waiting`` behind every sequence of a lower priority value, and behind
        (or, ``ahead_of_equals``, before) those of its own. With equal priorities (no QoS) the
        scan stops at once: an append, or an appendleft."""
        waiting = self.waiting
        if ahead_of_equals:
            i = 0
            while i < len(waiting) and waiting[i].priority < seq.priority:
                i += 1
        else:
            i = len(waiting)
            while i > 0 and waiting[i - 1].priority > seq.priority:
                i -= 1
        waiting.insert(i, seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their blocks."""
        out = SchedulerOutput()
        budget = self.max_num_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._last_token_pending(seq):  # nothing more to compute; the read-back ends it
                i += 1
                continue
            if self._never_fits(seq):
                self.running.pop(i)
                self._drop(seq)
                continue
            n = self._chunk(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget), budget)
            if not n:  # an image's span does not fit what is left of this step
                i += 1
                continue
            while not self.block_manager.allocate(seq, n):
                if self._evict_parked():
                    continue
                # The most recently admitted of the worst priority among those not yet given this
                # step (the last one when priorities are equal): never one already in ``out``.
                victim = max(reversed(self.running[i:]), key=attrgetter("priority"))
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        if out.preempted:
            return out  # the cache is short: admit nothing new this step
        j = 0  # the first waiting sequence not passed over (one whose grammar still compiles is)
        adapters = {s.adapter_id for s in self.running if s.adapter_id} if self.max_adapters else set()
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[j]
            if not seq.admissible or (seq.adapter_id and seq.adapter_id not in adapters
                                      and len(adapters) >= self.max_adapters > 0):
                j += 1  # its grammar compiles, or its adapter would not fit the pool beside the running ones
                continue
            if self._never_fits(seq):
                del self.waiting[j]
                self._drop(seq)
                continue
            prefix = PrefixMatch()
            fresh = seq.num_computed_tokens == 0 and not seq.block_table
            if fresh:
                # Counted on admission: a sequence that does not fit is looked up again next step.
                prefix = self.block_manager.find_prefix(seq.token_ids, count=False, images=seq.images,
                                                        adapter_id=seq.adapter_id)
            start = seq.num_computed_tokens + prefix.num_tokens
            n = self._chunk(seq, start, min(seq.num_uncomputed_tokens - prefix.num_tokens, budget), budget)
            if not n:  # an image's span does not fit what is left of this step: it waits for the next
                break
            if self.min_first_chunk_tokens and seq.num_computed_tokens == 0 and not prefix.num_tokens:
                # Its first chunk comes whole, so that what the cache derives from it does not
                # depend on what else this step carries: it waits for a step with room instead.
                if not seq.first_chunk_tokens:
                    seq.first_chunk_tokens = min(seq.num_tokens, self.min_first_chunk_tokens, self.max_num_tokens)
                if n < seq.first_chunk_tokens:
                    break
            while not self.block_manager.allocate(seq, n, prefix):
                if not self._evict_parked():
                    break
            else:
                del self.waiting[j]
                if fresh:
                    self.block_manager.count_prefix(seq.num_tokens, prefix)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if seq.adapter_id:
                    adapters.add(seq.adapter_id)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                continue
            if not self.running and not out.scheduled:
                # Nothing holds blocks and it still does not fit: it never will.
                del self.waiting[j]
                self._drop(seq)
                continue
            break
        return out

    def _chunk(self, seq: Sequence, start: int, n: int, budget: int) -> int:
        """``n`` new tokens from ``start``, or fewer, or (to finish an image's span the chunk starts
        in) more, so that no chunk ends inside an image's span; 0 when that span does not fit the
        ``budget`` left and the step already has work (an image is computed in one step)."""
        if not seq.images:
            return n
        whole = whole_image_chunk(seq.images, start, n)
        return 0 if whole > budget and budget < self.max_num_tokens else whole

    def _reached_limit(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a turn of ``num_tokens`` tokens has reached max_new_tokens or session_len."""
        return (num_tokens - seq.num_prompt_tokens >= seq.params.max_new_tokens
                or num_tokens >= self.session_len)

    def _last_token_pending(self, seq: Sequence) -> bool:
        """Whether ``seq``'s turn ends by count with a token still on the device."""
        return seq.num_pending_tokens > 0 and self._reached_limit(seq, seq.num_tokens)

    def _never_fits(self, seq: Sequence) -> bool:
        """Whether the KV of all of ``seq``'s known tokens is more than the whole cache holds."""
        return self.block_manager.blocks_needed(seq.num_tokens) > self.block_manager.num_blocks

    def _drop(self, seq: Sequence) -> None:
        """Finish a sequence the cache cannot hold with LENGTH; a session is not parked (nor its
        blocks kept): its turn ends FINISHED so that the engine reports it."""
        logger.warning("sequence %d needs more KV blocks than the cache has", seq.seq_id)
        self._drop_pending(seq)
        seq.finish_reason = Finish.LENGTH
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def _evict_parked(self) -> bool:
        """Drop the least recently used parked session's blocks; it keeps its token ids."""
        if not self.parked:
            return False
        self._release(next(iter(self.parked)))
        return True

    def release_idle(self, now: float, idle_s: float) -> int:
        """Free the blocks of every session parked at least ``idle_s`` seconds before ``now``
        (a ``clock()`` reading), oldest first; they keep their token ids, so a next turn
        recomputes them. Returns how many were released."""
        released = 0
        for session_id in list(self.parked):  # in park order, so parked_at only grows
            # The deadline, not the difference: (t + idle_s) - t can round to just below idle_s,
            # so a session checked exactly at its deadline would not count as idle.
            if now < self.parked_at[session_id] + idle_s:
                break
            self._release(session_id)
            released += 1
        return released

    def _release(self, session_id: int) -> None:
        """Take a session out of ``parked`` and free its blocks, if it is parked; its token ids
        stay, so its next turn recomputes them."""
        seq = self.parked.pop(session_id, None)
        self.parked_at.pop(session_id, None)
        if seq is not None:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_cached_tokens = 0  # everything is looked up (and recomputed) again
        seq.status = SequenceStatus.WAITING
        self._queue(seq, ahead_of_equals=True)  # it was admitted before the others of its priority
        out.preempted.append(seq)
        logger.info("preempted sequence %d (recompute later)", seq.seq_id)

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Apply a whole step at once (launch and read-back); returns the sequences it finished."""
        rows = [item.seq for item in out.scheduled if item.seq.seq_id in sampled]
        self.launched(out, rows)
        return [seq for seq in rows if self.resolve(seq, sampled[seq.seq_id]) is not None]

    def launched(self, out: SchedulerOutput, sampling: list[Sequence]) -> None:
        """Account for a step handed to the device: its tokens' KV counts as computed, and each
        sequence in ``sampling`` has one more token pending until the step is read back."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
            # The step in flight may still read what this gives back: a later step that reuses
            # the blocks writes them after it, in the device's stream order.
            self.block_manager.release_passed_blocks(item.seq)
        for seq in sampling:
            seq.num_pending_tokens += 1

    @staticmethod
    def awaits(seq: Sequence, request_id: str) -> bool:
        """Whether ``seq`` still waits for a token launched for request ``request_id`` (not when
        the turn ended since, by a stop, an abort or a dropped cache, nor for a later turn)."""
        return seq.request_id == request_id and seq.num_pending_tokens > 0

    def resolve(self, seq: Sequence, token: int) -> Finish | None:
        """Append ``seq``'s oldest pending token, now read back, and finish the turn on a stop
        token or a count limit; returns the finish reason, or None while the turn goes on."""
        seq.token_ids.append(token)
        seq.num_pending_tokens -= 1
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.release_passed_blocks(seq)  # the last known token moved on
        if token in seq.params.stop_token_ids:
            reason: Finish | None = Finish.STOP
        elif self._reached_limit(seq, len(seq.token_ids)):  # counted at this token, not the pending after it
            reason = Finish.LENGTH
        else:
            return None
        self.finish(seq, reason)
        return reason

    @staticmethod
    def _drop_pending(seq: Sequence) -> None:
        """Forget tokens still on the device (the turn ended before they were read back) and count
        the last known token's KV as not computed: the state a turn ends in without overlap."""
        seq.num_pending_tokens = 0
        seq.num_computed_tokens = min(seq.num_computed_tokens, max(len(seq.token_ids) - 1, 0))

    def _finish(self, seq: Sequence, reason: Finish) -> None:
        self._drop_pending(seq)
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if seq.session_id is not None:  # keep the KV for the next turn
            seq.status = SequenceStatus.PARKED
            self.parked[seq.session_id] = seq
            self.parked.move_to_end(seq.session_id)
            self.parked_at[seq.session_id] = self.clock()
        else:
            self.block_manager.free(seq)

    def finish(self, seq: Sequence, reason: Finish) -> None:
        """End a running or waiting sequence's turn (a stop token or limit, an abort, or a stop
        string the detokenizer found)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._finish(seq, reason)

    def end_session(self, session_id: int) -> None:
        """Forget a session and free its blocks (none left if it was evicted or released)."""
        self._release(session_id)
