"""Scheduler on a tiny simulated cache (no model): chunking, batching, preemption, stops, sessions."""

from __future__ import annotations

import pytest

from conveyor.engine.block_manager import BlockManager
from conveyor.protocol.sampling import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence, SequenceStatus
from conveyor.protocol import Finish as FinishReason

TOK = 7  # the token every step samples unless told otherwise
STOP = 2


class Clock:
    """A monotonic clock the test sets (idle timeouts without sleeping)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(num_blocks=8, block_size=4, max_batch_size=8, max_num_tokens=64, session_len=1000, prefix=False,
         clock=None, min_first_chunk_tokens=0):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, max_batch_size, max_num_tokens, session_len, clock=clock or Clock(),
                     min_first_chunk_tokens=min_first_chunk_tokens), bm


def seq(n_or_tokens, seq_id, max_new_tokens=100, session_id=None, start=0) -> Sequence:
    tokens = list(range(start, start + n_or_tokens)) if isinstance(n_or_tokens, int) else list(n_or_tokens)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[STOP])
    return Sequence(tokens, params, seq_id=seq_id, session_id=session_id)


def step(sched: Scheduler, tokens: dict[int, int] | None = None):
    """One engine step: schedule, then sample ``tokens[seq_id]`` (else TOK) for the sampling rows.

    Returns (what was scheduled as (seq_id, num_new_tokens, samples) triples, output, finished).
    """
    out = sched.schedule()
    sampled = {s.seq.seq_id: (tokens or {}).get(s.seq.seq_id, TOK) for s in out.scheduled if s.samples}
    plan = [(s.seq.seq_id, s.num_new_tokens, s.samples) for s in out.scheduled]
    finished = sched.update(out, sampled)
    return plan, out, finished


def run_until_idle(sched: Scheduler, max_steps=100) -> None:
    for _ in range(max_steps):
        if not sched.has_work:
            return
        step(sched)
    raise AssertionError("the scheduler did not drain")


def assert_no_leaks(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.running and not sched.waiting and not sched.parked and not sched.parked_at
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not bm._num_hashed


def test_chunked_prefill_samples_only_at_the_last_chunk():
    sched, bm = make(max_num_tokens=4)
    a = seq(10, 0, max_new_tokens=3)
    sched.add(a)
    assert a.status == SequenceStatus.WAITING
    plan, _, _ = step(sched)
    assert plan == [(0, 4, False)]
    assert a.status == SequenceStatus.RUNNING and a.num_computed_tokens == 4 and a.block_table == [0]
    plan, _, _ = step(sched)
    assert plan == [(0, 4, False)]
    assert a.num_computed_tokens == 8 and a.block_table == [0, 1] and a.num_tokens == 10
    plan, _, _ = step(sched)
    assert plan == [(0, 2, True)]
    assert a.num_computed_tokens == 10 and a.block_table == [0, 1, 2] and a.output_token_ids == [TOK]
    plan, _, fin = step(sched)
    assert plan == [(0, 1, True)] and fin == []
    plan, _, fin = step(sched)
    assert plan == [(0, 1, True)] and fin == [a]
    assert a.finish_reason == FinishReason.LENGTH and a.status == SequenceStatus.FINISHED
    assert a.output_token_ids == [TOK] * 3
    assert not sched.schedule()
    assert_no_leaks(sched)


def test_decode_runs_every_step_beside_a_chunked_prompt():
    sched, bm = make(max_num_tokens=4)
    a = seq(3, 0, max_new_tokens=6)
    sched.add(a)
    assert step(sched)[0] == [(0, 3, True)]
    b = seq(10, 1, max_new_tokens=2, start=100)
    sched.add(b)
    assert step(sched)[0] == [(0, 1, True), (1, 3, False)]
    assert step(sched)[0] == [(0, 1, True), (1, 3, False)]
    assert step(sched)[0] == [(0, 1, True), (1, 3, False)]
    assert step(sched)[0] == [(0, 1, True), (1, 1, True)]
    assert b.num_computed_tokens == 10 and b.output_token_ids == [TOK]
    assert a.block_table == [0, 2] and b.block_table == [1, 3, 4]
    plan, _, fin = step(sched)
    assert plan == [(0, 1, True), (1, 1, True)]
    assert fin == [a, b]  # a: 6 tokens, b: 2
    assert_no_leaks(sched)


def test_max_batch_size():
    sched, bm = make(max_batch_size=2)
    seqs = [seq(2, i, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan, _, fin = step(sched, {0: STOP})
    assert plan == [(0, 2, True), (1, 2, True)]
    assert fin == [seqs[0]] and seqs[0].finish_reason == FinishReason.STOP
    assert list(sched.waiting) == [seqs[2]]
    plan, _, _ = step(sched)
    assert plan == [(1, 1, True), (2, 2, True)]
    assert len(sched.running) == 2
    for s in list(sched.running):
        sched.finish(s, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_token_budget_limits_admission():
    sched, bm = make(max_num_tokens=6)
    a, b, c = seq(4, 0), seq(4, 1, start=10), seq(4, 2, start=20)
    for s in (a, b, c):
        sched.add(s)
    plan, _, _ = step(sched)
    assert plan == [(0, 4, True), (1, 2, False)]  # b gets the rest of the budget as a chunk
    plan, _, _ = step(sched)
    assert plan == [(0, 1, True), (1, 2, True), (2, 3, False)]
    for s in (a, b, c):
        sched.finish(s, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_first_chunks_bring_the_minimum_first_chunk_whole():
    """With a layout that asks for it (``min_first_chunk_tokens``) a first chunk is never cut below
    min(prompt, min_first_chunk_tokens, budget): the sequence waits for a step with room instead."""
    sched, bm = make(max_num_tokens=6, min_first_chunk_tokens=64)
    a, b, c = seq(4, 0, max_new_tokens=2), seq(8, 1, start=10), seq(4, 2, start=20)
    for s in (a, b, c):
        sched.add(s)
    plan, _, _ = step(sched)
    # b's first chunk must hold its minimum first chunk (min(8, 64, budget 6) = 6): 2 left, it waits.
    assert plan == [(0, 4, True)] and b.first_chunk_tokens == 6
    plan, _, _ = step(sched)
    assert plan == [(0, 1, True)]  # 5 left: still short
    plan, _, _ = step(sched)
    assert plan == [(1, 6, False)]
    plan, _, _ = step(sched)
    assert plan == [(1, 2, True), (2, 4, True)]  # later chunks take what the budget leaves
    for s in (b, c):
        sched.finish(s, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_first_chunk_tokens_stay_fixed_across_preemption():
    """A recomputed sequence's first chunk is fixed by its first run, though it now brings more
    (its prompt and what it generated): the cache derives the same state from the same tokens."""
    sched, bm = make(num_blocks=6, block_size=4, max_num_tokens=64, min_first_chunk_tokens=64)
    a = seq(10, 0)
    sched.add(a)
    step(sched)
    assert a.first_chunk_tokens == 10
    sched._preempt(a, sched.schedule())
    assert a.num_computed_tokens == 0 and a.num_tokens == 11
    plan, _, _ = step(sched)
    assert plan[0][:2] == (0, 11) and a.first_chunk_tokens == 10
    sched.finish(a, FinishReason.ABORT)
    assert_no_leaks(sched)


@pytest.mark.parametrize("policy", [0, 4])
def test_the_cache_layout_answers_set_first_chunks_and_head_blocks(policy: int):
    """Built as the engine builds them, from ``KVCacheLayout``'s answers rather than policy values:
    an int4 cache's first chunk waits for room for the layout's minimum and starts in a reserved
    head block; a 16-bit cache's takes what the budget leaves, anywhere."""
    from conveyor.kernels.kv_layout import KVCacheLayout  # torch: only this test needs it

    layout = KVCacheLayout(policy, 64)
    bm = BlockManager(64, 4, num_head_blocks=layout.reserved_head_blocks(max_batch_size=2, num_blocks=64))
    sched = Scheduler(bm, 2, 64, 1000, clock=Clock(), min_first_chunk_tokens=layout.min_first_chunk_tokens)
    a, b = seq(10, 0, max_new_tokens=1), seq(100, 1, start=100)
    for s in (a, b):
        sched.add(s)
    plan, _, _ = step(sched)
    if policy:  # 54 tokens left in the budget, fewer than the layout's 64: b waits a step
        assert plan == [(0, 10, True)] and b.first_chunk_tokens == 64
        plan, _, _ = step(sched)
        assert plan == [(1, 64, False)]
        assert bm.num_head_blocks == 4 and a.block_table == [] and b.block_table[0] < bm.num_head_blocks
    else:
        assert plan == [(0, 10, True), (1, 54, False)] and b.first_chunk_tokens == 0
        assert bm.num_head_blocks == 0
    sched.finish(b, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_preemption_recompute_and_resume():
    sched, bm = make()  # 8 blocks of 4
    a, b, c = seq(12, 0, start=0), seq(12, 1, start=100), seq(7, 2, start=200)
    for s in (a, b, c):
        sched.add(s)
    plan, _, _ = step(sched)
    assert plan == [(0, 12, True), (1, 12, True), (2, 7, True)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4, 5], [6, 7])
    assert bm.num_free_blocks == 0
    d = seq(4, 3, start=300)
    sched.add(d)
    # a and b need a 4th block each: the last admitted (c) is preempted; nothing new is admitted.
    plan, out, _ = step(sched)
    assert out.preempted == [c]
    assert plan == [(0, 1, True), (1, 1, True)]
    assert (a.block_table, b.block_table) == ([0, 1, 2, 6], [3, 4, 5, 7])
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.token_ids == list(range(200, 207)) + [TOK] and c.output_token_ids == [TOK]
    assert list(sched.waiting) == [c, d]  # to the front, before d
    assert sched.running == [a, b]
    # Still no room for c: it waits (and d behind it).
    plan, out, _ = step(sched, {0: STOP})
    assert plan == [(0, 1, True), (1, 1, True)] and not out.preempted
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == FinishReason.STOP
    assert list(sched.waiting) == [c, d]
    # a's blocks came back: c recomputes its prompt and its generated token, then samples on.
    plan, _, _ = step(sched)
    assert plan == [(1, 1, True), (2, 8, True), (3, 4, True)]
    assert c.block_table == [0, 1] and d.block_table == [2]
    assert c.status == SequenceStatus.RUNNING and c.num_computed_tokens == 8
    assert c.output_token_ids == [TOK, TOK] and c.num_prompt_tokens == 7
    # c needs a 3rd block (the last free one); then d, last admitted, has none for its 2nd.
    plan, out, _ = step(sched)
    assert plan == [(1, 1, True), (2, 1, True)] and out.preempted == [d]
    assert c.block_table == [0, 1, 6] and list(sched.waiting) == [d]
    for s in list(sched.running) + list(sched.waiting):
        sched.finish(s, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_last_running_sequence_preempts_itself():
    sched, bm = make(num_blocks=4)
    a, b = seq(7, 0, start=0), seq(8, 1, start=100)
    sched.add(a)
    sched.add(b)
    assert step(sched)[0] == [(0, 7, True), (1, 8, True)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    # a (8 tokens) still fits in 2 blocks; b (9) needs a 3rd, none is free and b is the last admitted.
    plan, out, _ = step(sched)
    assert plan == [(0, 1, True)] and out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and list(sched.waiting) == [b]
    assert list(bm._free) == [2, 3]
    # a grows into b's old blocks; b (9 tokens, 3 blocks) waits until there is room.
    plan, out, _ = step(sched)
    assert plan == [(0, 1, True)] and not out.preempted
    assert a.block_table == [0, 1, 2] and list(sched.waiting) == [b]
    sched.finish(a, FinishReason.ABORT)
    plan, _, _ = step(sched)
    assert plan == [(1, 9, True)] and b.block_table == [0, 1, 2]
    sched.finish(b, FinishReason.ABORT)
    assert_no_leaks(sched)


@pytest.mark.parametrize("how", ["stop", "max_new_tokens", "session_len"])
def test_stop_conditions_free_blocks(how):
    sched, bm = make(session_len=7)
    a = seq(4, 0, max_new_tokens=2 if how == "max_new_tokens" else 100)
    sched.add(a)
    tokens = {0: STOP} if how == "stop" else None
    plan, _, fin = step(sched, tokens)
    if how == "stop":
        assert fin == [a] and a.finish_reason == FinishReason.STOP and a.output_token_ids == [STOP]
    else:
        assert fin == [] and bm.num_free_blocks == 7
        plan, _, fin = step(sched)
        if how == "max_new_tokens":
            assert fin == [a] and a.num_output_tokens == 2
        else:
            assert fin == []
            plan, _, fin = step(sched)
            assert fin == [a] and a.num_tokens == 7
        assert a.finish_reason == FinishReason.LENGTH
    assert a.status == SequenceStatus.FINISHED and a.block_table == []
    assert_no_leaks(sched)


def test_stop_token_in_a_chunk_row_is_not_sampled():
    """A non-sampling chunk ignores stop ids in the prompt itself."""
    sched, bm = make(max_num_tokens=4)
    a = seq([STOP, STOP, STOP, STOP, STOP], 0)
    sched.add(a)
    plan, _, fin = step(sched)
    assert plan == [(0, 4, False)] and fin == []
    plan, _, fin = step(sched, {0: STOP})
    assert plan == [(0, 1, True)] and fin == [a]
    assert_no_leaks(sched)


def test_session_parks_and_next_turn_reuses_blocks():
    sched, bm = make()
    s = seq(6, 0, max_new_tokens=2, session_id=11)
    sched.add(s)
    assert step(sched)[0] == [(0, 6, True)]
    plan, _, fin = step(sched)
    assert plan == [(0, 1, True)] and fin == [s]
    assert s.status == SequenceStatus.PARKED and s.finish_reason == FinishReason.LENGTH
    assert not s.is_finished
    assert list(sched.parked) == [11] and not sched.running and not sched.has_work
    assert s.block_table == [0, 1] and s.num_computed_tokens == 7 and s.num_tokens == 8
    assert bm.num_free_blocks == 6
    assert not sched.schedule()
    # Next turn: only the last sampled token and the new ones are computed.
    s.start_turn([50, 51, 52], SamplingParams(max_new_tokens=1))
    sched.add(s)
    assert not sched.parked and s.status == SequenceStatus.WAITING
    plan, _, fin = step(sched)
    assert plan == [(0, 4, True)] and fin == [s]
    assert s.block_table == [0, 1, 2] and s.num_computed_tokens == 11
    assert s.output_token_ids == [TOK] and s.num_prompt_tokens == 11
    assert s.status == SequenceStatus.PARKED and bm.num_free_blocks == 5
    sched.end_session(11)
    assert s.status == SequenceStatus.FINISHED and s.block_table == []
    sched.end_session(11)  # twice is harmless
    assert_no_leaks(sched)


def test_parked_session_evicted_before_preempting():
    sched, bm = make()
    s = seq(12, 0, max_new_tokens=1, session_id=5, start=500)
    a = seq(19, 1, max_new_tokens=3)
    sched.add(s)
    sched.add(a)
    plan, _, fin = step(sched)
    assert plan == [(0, 12, True), (1, 19, True)] and fin == [s]
    assert s.status == SequenceStatus.PARKED and s.block_table == [0, 1, 2]
    assert a.block_table == [3, 4, 5, 6, 7] and bm.num_free_blocks == 0
    assert step(sched)[0] == [(1, 1, True)]  # 20 tokens: 5 blocks still
    plan, out, fin = step(sched)  # 21 tokens: a 6th block, from the parked session
    assert plan == [(1, 1, True)] and not out.preempted and fin == [a]
    assert not sched.parked and s.status == SequenceStatus.FINISHED
    assert s.block_table == [] and s.num_computed_tokens == 0
    assert s.token_ids == list(range(500, 512)) + [TOK]  # its history stays
    assert bm.num_free_blocks == 8  # a finished too
    # Its next turn recomputes everything.
    s.start_turn([60, 61], SamplingParams(max_new_tokens=1))
    sched.add(s)
    plan, _, fin = step(sched)
    assert plan == [(0, 15, True)] and fin == [s]
    assert s.block_table == [3, 4, 5, 6]
    sched.end_session(5)
    assert_no_leaks(sched)


def test_parked_sessions_evicted_lru_first():
    sched, bm = make()
    s1 = seq(7, 0, max_new_tokens=1, session_id=1, start=100)
    s2 = seq(7, 1, max_new_tokens=1, session_id=2, start=200)
    s3 = seq(7, 2, max_new_tokens=1, session_id=3, start=300)
    for s in (s1, s2, s3):
        sched.add(s)
    step(sched)
    assert list(sched.parked) == [1, 2, 3]
    assert (s1.block_table, s2.block_table, s3.block_table) == ([0, 1], [2, 3], [4, 5])
    # s1 takes another turn (so it is the most recently used when it parks again).
    s1.start_turn([9], SamplingParams(max_new_tokens=1))
    sched.add(s1)
    assert step(sched)[0] == [(0, 2, True)]
    assert s1.block_table == [0, 1, 6]
    assert list(sched.parked) == [2, 3, 1]
    # 8 tokens need 2 blocks, 1 is free: s2 (least recently used) goes, s3 and s1 stay.
    a = seq(8, 9, max_new_tokens=2, start=900)
    sched.add(a)
    plan, out, fin = step(sched)
    assert plan == [(9, 8, True)] and not out.preempted
    assert a.block_table == [2, 3]
    sched.finish(a, FinishReason.ABORT)
    assert s2.status == SequenceStatus.FINISHED and s2.block_table == []
    assert list(sched.parked) == [3, 1] and list(sched.parked_at) == [3, 1]
    for sid in (1, 3):
        sched.end_session(sid)
    assert_no_leaks(sched)


def _park(sched: Scheduler, s: Sequence) -> None:
    """Run ``s`` (one new token) until its session parks."""
    sched.add(s)
    run_until_idle(sched)
    assert s.status == SequenceStatus.PARKED


def test_idle_parked_sessions_are_released_oldest_first():
    clock = Clock(100.0)
    sched, bm = make(clock=clock)
    s1 = seq(7, 0, max_new_tokens=1, session_id=1, start=100)
    s2 = seq(7, 1, max_new_tokens=1, session_id=2, start=200)
    s3 = seq(7, 2, max_new_tokens=1, session_id=3, start=300)
    for t, s in ((100.0, s1), (105.0, s2), (110.0, s3)):
        clock.t = t
        _park(sched, s)
    assert list(sched.parked) == [1, 2, 3] and sched.parked_at == {1: 100.0, 2: 105.0, 3: 110.0}
    assert bm.num_free_blocks == 2
    assert sched.release_idle(now=109.9, idle_s=10) == 0  # none idle for 10 s yet
    assert bm.num_free_blocks == 2 and list(sched.parked) == [1, 2, 3]
    # At 115: s1 idle 15 s, s2 exactly 10 s (released), s3 5 s (kept).
    assert sched.release_idle(now=115.0, idle_s=10) == 2
    assert list(sched.parked) == [3] and list(sched.parked_at) == [3]
    assert bm.num_free_blocks == 6 and s3.block_table == [4, 5] and s3.status == SequenceStatus.PARKED
    for s, start in ((s1, 100), (s2, 200)):
        assert s.status == SequenceStatus.FINISHED and s.block_table == [] and s.num_computed_tokens == 0
        assert s.token_ids == list(range(start, start + 7)) + [TOK]  # the history stays
    assert sched.release_idle(now=115.0, idle_s=10) == 0  # nothing is released twice
    assert sched.release_idle(now=120.0, idle_s=10) == 1
    assert bm.num_free_blocks == bm.num_blocks
    for sid in (1, 2, 3):
        sched.end_session(sid)  # after a release: nothing left to free, no double free
    assert_no_leaks(sched)


def test_a_new_turn_restarts_the_idle_clock():
    clock = Clock(0.0)
    sched, bm = make(clock=clock)
    s1 = seq(7, 0, max_new_tokens=1, session_id=1, start=100)
    s2 = seq(7, 1, max_new_tokens=1, session_id=2, start=200)
    _park(sched, s1)
    clock.t = 1.0
    _park(sched, s2)
    clock.t = 8.0  # s1 takes another turn, so it parks after s2 and its idle time starts again
    s1.start_turn([9], SamplingParams(max_new_tokens=1))
    sched.add(s1)
    assert 1 not in sched.parked_at  # a running turn is never released
    assert sched.release_idle(now=100.0, idle_s=1) == 1 and s2.block_table == []
    run_until_idle(sched)
    assert list(sched.parked) == [1] and sched.parked_at == {1: 8.0}
    assert sched.release_idle(now=12.0, idle_s=5) == 0  # idle 4 s
    assert s1.block_table == [0, 1, 2] and s1.status == SequenceStatus.PARKED  # 2: s2's, freed
    assert sched.release_idle(now=13.0, idle_s=5) == 1 and s1.block_table == []
    assert bm.num_free_blocks == bm.num_blocks
    for sid in (1, 2):
        sched.end_session(sid)
    assert_no_leaks(sched)


def test_released_session_next_turn_recomputes_its_history():
    clock = Clock(50.0)
    sched, bm = make(clock=clock)
    s = seq(12, 0, max_new_tokens=1, session_id=5, start=500)
    _park(sched, s)
    assert s.block_table == [0, 1, 2] and s.num_computed_tokens == 12 and bm.num_free_blocks == 5
    assert sched.release_idle(now=50.0 + 600, idle_s=600) == 1
    assert bm.num_free_blocks == 8 and s.num_computed_tokens == 0
    # The next turn computes all 15 tokens again (kept, 3 would be computed) and parks as usual.
    s.start_turn([60, 61], SamplingParams(max_new_tokens=1, stop_token_ids=[STOP]))
    sched.add(s)
    plan, _, fin = step(sched)
    assert plan == [(0, 15, True)] and fin == [s]
    assert s.token_ids == list(range(500, 512)) + [TOK, 60, 61, TOK]
    assert s.status == SequenceStatus.PARKED and s.block_table == [0, 1, 2, 3]  # freed ones first
    sched.end_session(5)
    sched.end_session(5)
    assert_no_leaks(sched)


def test_abort_running_and_waiting():
    sched, bm = make(max_batch_size=1)
    a, b = seq(5, 0), seq(5, 1, start=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    assert bm.num_free_blocks == 6
    sched.finish(b, FinishReason.ABORT)
    assert b.status == SequenceStatus.FINISHED and b.finish_reason == FinishReason.ABORT
    assert not sched.waiting
    sched.finish(a, FinishReason.ABORT)
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == FinishReason.ABORT
    assert a.block_table == [] and not sched.running
    sched.finish(a, FinishReason.STOP)  # already finished: nothing happens
    assert a.finish_reason == FinishReason.ABORT
    assert_no_leaks(sched)


def test_abort_session_turn_waiting_with_blocks():
    sched, bm = make()
    s = seq(5, 0, max_new_tokens=1, session_id=3)
    sched.add(s)
    step(sched)
    assert s.block_table == [0, 1]
    s.start_turn([1, 2], SamplingParams(max_new_tokens=1))
    sched.add(s)
    sched.finish(s, FinishReason.ABORT)  # from WAITING: parked again with its blocks
    assert s.status == SequenceStatus.PARKED and s.block_table == [0, 1]
    assert list(sched.parked) == [3] and not sched.waiting
    sched.end_session(3)
    assert_no_leaks(sched)


def test_abort_preempted_waiting_sequence():
    sched, bm = make(num_blocks=4)
    a, b = seq(8, 0), seq(8, 1, start=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    _, out, _ = step(sched)
    assert out.preempted == [b] and b.status == SequenceStatus.WAITING
    sched.finish(b, FinishReason.ABORT)
    assert b.status == SequenceStatus.FINISHED and not sched.waiting
    sched.finish(a, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_prompt_that_never_fits_is_finished_with_length():
    sched, bm = make(num_blocks=4)  # 16 tokens in all
    big, ok = seq(17, 0), seq(4, 1, start=100, max_new_tokens=1)
    sched.add(big)
    sched.add(ok)
    plan, out, fin = step(sched)
    assert plan == [(1, 4, True)] and fin == [ok]
    assert big.status == SequenceStatus.FINISHED and big.finish_reason == FinishReason.LENGTH
    assert not sched.has_work
    assert_no_leaks(sched)


def test_chunked_prompt_that_never_fits_does_not_hang():
    sched, bm = make(num_blocks=4, max_num_tokens=4)
    big = seq(20, 0)
    sched.add(big)
    run_until_idle(sched)
    assert big.status == SequenceStatus.FINISHED and big.finish_reason == FinishReason.LENGTH
    assert_no_leaks(sched)


def test_generation_past_the_cache_is_finished_with_length():
    """A lone decode that outgrows the whole cache would otherwise preempt itself forever."""
    sched, bm = make(num_blocks=4, max_num_tokens=4)
    a = seq(14, 0)
    sched.add(a)
    run_until_idle(sched)
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == FinishReason.LENGTH
    assert a.num_tokens == 17 and a.output_token_ids == [TOK] * 3  # 16 computed, a 17th sampled
    assert_no_leaks(sched)


def test_session_that_outgrows_the_cache_is_finished_not_parked():
    sched, bm = make(num_blocks=4)
    s = seq(15, 0, session_id=8)
    sched.add(s)
    step(sched)
    step(sched)
    assert s.num_tokens == 17
    plan, _, _ = step(sched)
    assert plan == []
    assert s.status == SequenceStatus.FINISHED and s.finish_reason == FinishReason.LENGTH
    assert not sched.parked
    assert_no_leaks(sched)


def test_prefix_caching_in_the_scheduler():
    sched, bm = make(prefix=True)
    system = list(range(100, 108))
    a = seq(system + [1, 2], 0, max_new_tokens=3)
    sched.add(a)
    plan, _, _ = step(sched)
    assert plan == [(0, 10, True)] and a.num_cached_tokens == 0
    b = seq(system + [3, 4, 5], 1, max_new_tokens=2)
    sched.add(b)
    plan, _, fin = step(sched)
    assert plan == [(0, 1, True), (1, 3, True)] and fin == []
    assert b.num_cached_tokens == 8 and a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert [blk.ref_count for blk in bm.blocks[:5]] == [2, 2, 1, 1, 0]
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (21, 8)
    run_until_idle(sched)
    assert a.finish_reason == b.finish_reason == FinishReason.LENGTH
    assert_no_leaks(sched)


def test_preempted_sequence_rehits_its_own_blocks():
    sched, bm = make(num_blocks=4, prefix=True)
    a, b = seq(8, 0), seq(8, 1, start=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    _, out, _ = step(sched)  # a needs a 3rd block: b is preempted, its tail block is reused
    assert out.preempted == [b] and a.block_table == [0, 1, 3]
    sched.finish(a, FinishReason.ABORT)
    assert list(bm._free) == [3, 2, 1, 0]
    # b's head block survived on the free list: only the rest is recomputed.
    plan, _, _ = step(sched)
    assert plan == [(1, 5, True)]
    assert b.block_table == [2, 3, 1] and b.num_cached_tokens == 4
    sched.finish(b, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_preemption_resets_cached_token_count():
    sched, bm = make(num_blocks=6, prefix=True)
    p = list(range(100, 108))
    a = seq(p + [50], 0, max_new_tokens=1)
    sched.add(a)
    step(sched)
    assert list(bm._free) == [2, 3, 4, 5, 1, 0]
    c, b = seq(7, 2, start=300), seq(p + [60], 1)
    sched.add(c)
    sched.add(b)
    plan, _, _ = step(sched)
    assert plan == [(2, 7, True), (1, 1, True)]
    assert c.block_table == [2, 3] and b.block_table == [0, 1, 4] and b.num_cached_tokens == 8
    for _ in range(3):
        plan, out, _ = step(sched)
        assert plan == [(2, 1, True), (1, 1, True)] and not out.preempted
    assert c.block_table == [2, 3, 5] and b.num_tokens == 13
    plan, out, _ = step(sched)  # b needs a 4th block: b, the last admitted, is preempted
    assert plan == [(2, 1, True)] and out.preempted == [b]
    assert b.num_cached_tokens == 0
    sched.finish(c, FinishReason.ABORT)
    plan, _, _ = step(sched)
    assert plan == [(1, 1, True)]
    assert b.block_table == [0, 1, 4, 5] and b.num_cached_tokens == 12
    sched.finish(b, FinishReason.ABORT)
    assert_no_leaks(sched)


def test_prefix_lookups_of_a_waiting_sequence_count_once():
    # a holds 7 of 8 blocks; b (8 tokens, 2 blocks + 1 for its first token) waits several steps.
    sched, bm = make(prefix=True)
    a = seq(26, 0, max_new_tokens=3)
    sched.add(a)
    step(sched)
    b = seq(8, 1, max_new_tokens=1, start=100)
    sched.add(b)
    for _ in range(2):
        plan, _, _ = step(sched)
        assert [p[0] for p in plan] == [0]  # b does not fit yet
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (26, 0)
    run_until_idle(sched)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (34, 0)
    assert bm.num_free_blocks == bm.num_blocks
