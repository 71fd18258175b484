"""Blocks that leave the sliding window of every layer go back to the block manager.

A window W: the query at position p sees the keys p - W < k <= p. Where every layer slides, a
running sequence gives back each block wholly before the window of the earliest query it can
still bring; its block-table entry then names its first kept block. Checked on the block manager
(exact blocks at every step), on the scheduler (preemption, sessions, tokens still on the device)
and end to end on a tiny random Mistral against transformers' ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import TINY, random_tokens, save_tiny
from test_scheduler import assert_no_leaks, make, run_until_idle, step
from test_scheduler import seq as sched_seq
from transformers import MistralConfig

from conveyor.engine.block_manager import BlockManager, PrefixMatch
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence, SequenceStatus
from conveyor.protocol import Finish as FinishReason
from conveyor.protocol.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

BS = 4
W = 8
NO_PREFIX = PrefixMatch()  # frozen: one shared default is safe


def seq(tokens, seq_id=None) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), seq_id=seq_id)


class Tracked:
    """A sequence driven through the block manager as the scheduler would (launch, then read
    back), remembering the block each table entry got when it was allocated."""

    def __init__(self, bm: BlockManager, s: Sequence):
        self.bm, self.s, self.original = bm, s, list(s.block_table)

    def allocate(self, n: int, prefix: PrefixMatch = NO_PREFIX) -> None:
        assert self.bm.allocate(self.s, n, prefix)
        self.original += self.s.block_table[len(self.original):]

    def advance(self, n: int, sampled: int | None = None) -> None:
        """One step of ``n`` tokens; ``sampled``: the token it samples, read back at once."""
        self.allocate(n)
        self.s.num_computed_tokens += n
        self.bm.cache_full_blocks(self.s)
        self.bm.release_passed_blocks(self.s)
        if sampled is not None:
            self.s.token_ids.append(sampled)
            self.bm.cache_full_blocks(self.s)
            self.bm.release_passed_blocks(self.s)

    @property
    def held(self) -> int:
        return len(self.s.block_table) - self.s.num_released_blocks

    def check(self) -> None:
        """The kept entries are the blocks allocated there; the released ones name the first kept
        block after them; every key a future query may see is in a kept block."""
        s, bm, lo = self.s, self.bm, self.bm._first_releasable
        r = s.num_released_blocks
        table = s.block_table
        assert len(table) == len(self.original)
        for i, block_id in enumerate(table):
            if lo <= i < lo + r:
                assert block_id == table[lo + r]
            else:
                assert block_id == self.original[i] and bm.blocks[block_id].ref_count >= 1
        first_query = min(s.num_computed_tokens, len(s.token_ids) - 1)
        for k in range(max(first_query - bm.window + 1, 0), s.num_computed_tokens):
            assert table[k // bm.block_size] == self.original[k // bm.block_size]


def expected_released(first_query: int, window: int, bs: int) -> int:
    """Blocks wholly before the query's window, less the last of them when the block after
    them is not yet full of computed keys (the released entries name that block)."""
    passed = sum(1 for i in range(first_query // bs + 1) if (i + 1) * bs <= first_query - window + 1)
    return max(min(passed, first_query // bs - 1), 0)


@pytest.mark.parametrize("window,bs", [(8, 4), (6, 4), (2, 4), (5, 2), (1, 1)])
def test_decode_past_the_window_releases_each_block_as_it_leaves(window: int, bs: int):
    bm = BlockManager(64, bs, window=window)
    t = Tracked(bm, seq(range(10)))
    t.advance(10, sampled=99)
    for c in range(10, 60):
        assert t.s.num_computed_tokens == c
        assert t.s.num_released_blocks == expected_released(c, window, bs)
        t.check()
        assert bm.num_free_blocks == bm.num_blocks - t.held
        assert t.held <= -(-window // bs) + 2
        t.advance(1, sampled=c)
    bm.free(t.s)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_decode_released_counts_by_hand():
    """W = 8, block size 4: block i (positions 4i..4i+3) goes once the next query is at 4i + 11."""
    bm = BlockManager(64, BS, window=W)
    t = Tracked(bm, seq(range(10)))
    t.advance(10, sampled=99)
    released = {}
    for c in range(10, 24):
        released[c] = t.s.num_released_blocks
        t.advance(1, sampled=c)
    assert released == {10: 0, 11: 1, 12: 1, 13: 1, 14: 1, 15: 2, 16: 2, 17: 2, 18: 2, 19: 3, 20: 3, 21: 3,
                        22: 3, 23: 4}
    # A window no wider than a block: block 0 is passed at query 5 but named by the released
    # entries until block 1 is full of computed keys.
    bm = BlockManager(64, BS, window=2)
    t = Tracked(bm, seq(range(5)))
    t.advance(5, sampled=99)
    assert t.s.num_released_blocks == 0
    t.advance(1, sampled=1)
    t.advance(1, sampled=1)
    t.advance(1, sampled=1)
    assert t.s.num_computed_tokens == 8 and t.s.num_released_blocks == 1
    assert t.s.block_table[0] == t.s.block_table[1] == t.original[1]


def test_chunked_prefill_releases_between_chunks():
    bm = BlockManager(16, BS, window=W)
    t = Tracked(bm, seq(range(30)))
    t.advance(8)
    assert t.s.num_released_blocks == 0 and t.held == 2
    t.advance(8)  # the next chunk's first query (16) sees keys 9..16: blocks 0 and 1 are passed
    assert t.s.num_released_blocks == 2 and t.held == 2
    t.check()
    assert bm.num_free_blocks == 14 and bm.usage == pytest.approx(2 / 16)
    t.advance(8)
    assert t.s.num_released_blocks == 4 and t.held == 2
    t.check()
    t.advance(6, sampled=7)  # the last chunk samples; the next query is at 30
    assert t.s.num_released_blocks == 5 and t.held == 3 and len(t.s.block_table) == 8
    t.check()
    # What was released is free for another sequence.
    other = seq(range(100, 152))
    assert bm.can_allocate(other, 52) and not bm.can_allocate(other, 53)
    bm.free(t.s)
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)


def test_no_window_or_short_context_releases_nothing():
    bm = BlockManager(16, BS)
    t = Tracked(bm, seq(range(30)))
    t.advance(30, sampled=1)
    assert t.s.num_released_blocks == 0 and t.held == 8
    bm = BlockManager(16, BS, window=64)
    t = Tracked(bm, seq(range(30)))
    t.advance(30, sampled=1)
    assert t.s.num_released_blocks == 0 and t.held == 8
    with pytest.raises(ValueError):
        BlockManager(16, BS, window=0)


def test_a_centred_cache_keeps_the_head_block():
    """The layout keys a sequence's per-sequence state by its first block: it stays held, and the
    released entries come after it."""
    bm = BlockManager(16, BS, num_head_blocks=4, window=W)
    t = Tracked(bm, seq(range(20)))
    t.advance(20, sampled=1)  # next query 20 sees 13..20: blocks 0..2 are passed, block 0 stays
    assert t.s.num_released_blocks == 2 and t.s.block_table[0] == t.original[0] == 0
    assert t.s.block_table[1:3] == [t.original[3]] * 2
    t.check()
    assert t.held == 3 and bm.num_free_blocks == 13
    bm.free(t.s)
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)


def test_released_hashed_blocks_stay_in_the_prefix_cache():
    bm = BlockManager(16, BS, enable_prefix_caching=True, window=W)
    prompt = list(range(20))
    a = Tracked(bm, seq(prompt))
    a.advance(20, sampled=1)
    assert a.s.num_released_blocks == 3
    released = a.original[:3]
    assert all(bm.blocks[b].ref_count == 0 and bm.blocks[b].block_hash is not None for b in released)
    # Tail first, as a finished sequence's blocks go: the chain's head is evicted last.
    assert list(bm._free)[-3:] == released[::-1]
    # The same prompt finds the whole chain: the released blocks are revived, the kept ones shared.
    b = Tracked(bm, seq(prompt + [5]))
    match = bm.find_prefix(b.s.token_ids)
    assert match.block_ids == tuple(a.original[:5]) and match.num_tokens == 20
    assert bm.can_allocate(b.s, 1, match)
    free_before = bm.num_free_blocks
    b.allocate(1, match)
    assert bm.num_free_blocks == free_before - 3 - 1  # three revived, one fresh
    assert [bm.blocks[i].ref_count for i in a.original[3:5]] == [2, 2]
    b.s.num_computed_tokens += 1
    bm.cache_full_blocks(b.s)
    bm.release_passed_blocks(b.s)  # its next query (21) sees 14..21: blocks 0..2 go back again
    assert b.s.num_released_blocks == 3
    b.check()
    bm.free(b.s)
    bm.free(a.s)
    assert bm.num_free_blocks == 16 and all(r.ref_count == 0 for r in bm.blocks)
    assert bm.find_prefix(prompt + [5], count=False).num_tokens == 20  # all still cached


def test_prefix_hit_stops_where_released_blocks_were_evicted():
    """A chain whose released blocks were reused by another sequence is matched up to the first
    missing block; the rest is computed again. The match still brings the keys the first new
    query sees (its window lies in the matched blocks or in the recomputed tokens)."""
    bm = BlockManager(8, BS, enable_prefix_caching=True, window=W)
    prompt = list(range(20))
    a = Tracked(bm, seq(prompt))
    a.advance(20, sampled=1)  # blocks 0..4, then 0..2 released: free list ends 5, 6, 7, 2, 1, 0
    other = Tracked(bm, seq(range(100, 116)))
    other.allocate(16)  # takes the three never-used blocks, then evicts the chain's block 2
    assert a.original[2] in other.s.block_table and a.original[1] not in other.s.block_table
    match = bm.find_prefix(prompt + [5])
    assert match.block_ids == tuple(a.original[:2]) and match.num_tokens == 8
    bm.free(other.s)
    b = Tracked(bm, seq(prompt + [5]))
    b.allocate(13, match)
    assert b.s.num_computed_tokens == 8 and b.s.num_cached_tokens == 8
    assert b.s.block_table[:2] == a.original[:2] and b.s.block_table[2] != a.original[2]
    # The recompute's first query (8) sees keys 1..8: all in the matched blocks and the chunk.
    b.check()
    b.s.num_computed_tokens += 13
    bm.cache_full_blocks(b.s)
    bm.release_passed_blocks(b.s)
    assert b.s.num_released_blocks == 3
    b.check()
    # The block recomputed for positions 8..11 had the same content: the cache keeps one copy.
    assert bm.find_prefix(prompt + [5], count=False).num_tokens == 20
    bm.free(b.s)
    bm.free(a.s)
    assert bm.num_free_blocks == 8 and all(r.ref_count == 0 for r in bm.blocks)


def test_first_block_evicted_breaks_the_whole_chain():
    bm = BlockManager(8, BS, enable_prefix_caching=True, window=W)
    prompt = list(range(20))
    a = Tracked(bm, seq(prompt))
    a.advance(20, sampled=1)
    other = Tracked(bm, seq(range(100, 124)))
    other.allocate(24)  # everything free: the chain's blocks 0..2 are all reused
    assert bm.find_prefix(prompt + [5]) == PrefixMatch()  # blocks 3 and 4 alone are no match
    bm.free(other.s)
    bm.free(a.s)
    assert bm.num_free_blocks == 8


# ---- through the scheduler ---------------------------------------------------------------------

def windowed(num_blocks=8, max_num_tokens=64, prefix=False) -> tuple[Scheduler, BlockManager]:
    sched, _ = make(num_blocks=num_blocks, max_num_tokens=max_num_tokens, prefix=prefix)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix, window=W)
    sched.block_manager = bm
    return sched, bm


def held(s: Sequence) -> int:
    return len(s.block_table) - s.num_released_blocks


def test_two_sequences_fit_where_their_whole_contexts_would_not():
    """40 tokens need 10 blocks; with W = 8 a sequence holds at most 4 at a time, and two run side
    by side in 12 blocks without preemption."""
    sched, bm = windowed(num_blocks=12, max_num_tokens=8)
    a, b = sched_seq(12, 0, max_new_tokens=28), sched_seq(12, 1, max_new_tokens=28, start=50)
    sched.add(a)
    sched.add(b)
    most = 0
    for _ in range(100):
        if not sched.has_work:
            break
        _, out, _ = step(sched)
        assert not out.preempted
        most = max(most, held(a), held(b))
        assert bm.num_free_blocks == bm.num_blocks - held(a) - held(b)
    assert a.finish_reason == b.finish_reason == FinishReason.LENGTH and a.num_tokens == b.num_tokens == 40
    assert most <= W // BS + 2
    assert_no_leaks(sched)


def test_preemption_frees_only_held_blocks():
    """Two sequences of 20 tokens (5 blocks each, the whole cache) outgrow 5 blocks together even
    with their windows: the worse-priority one is preempted while two of its entries are released
    ones (at its sixth step, 17 tokens)."""
    sched, bm = windowed(num_blocks=5, max_num_tokens=16)
    a, b = sched_seq(4, 0, max_new_tokens=16), sched_seq(12, 1, max_new_tokens=8, start=50)
    b.priority = 1
    sched.add(a)
    sched.add(b)
    preempted_with_released = 0
    for _ in range(200):
        if not sched.has_work:
            break
        released_before = {s.seq_id: s.num_released_blocks for s in (a, b)}
        _, out, _ = step(sched)
        for p in out.preempted:  # free() gave back the held blocks once, and the table is empty
            assert p.block_table == [] and p.num_released_blocks == 0 and p.num_computed_tokens == 0
            preempted_with_released += released_before[p.seq_id] > 0
        assert bm.num_free_blocks == bm.num_blocks - held(a) - held(b)
    assert preempted_with_released, "meant to preempt a sequence holding released entries"
    assert a.num_tokens == b.num_tokens == 20
    assert_no_leaks(sched)


def test_session_turns_keep_their_window():
    sched, bm = windowed(num_blocks=10, max_num_tokens=8)
    s = sched_seq(10, 0, max_new_tokens=12, session_id=5)
    sched.add(s)
    run_until_idle(sched)
    assert s.status == SequenceStatus.PARKED and s.num_computed_tokens == 21 and len(s.token_ids) == 22
    assert s.num_released_blocks == 3 and held(s) == 3  # the next query (21) sees 14..21
    kept = s.block_table[3:]
    s.start_turn(list(range(60, 70)), SamplingParams(max_new_tokens=5, stop_token_ids=[2]))
    sched.add(s)
    _, out, _ = step(sched)  # the turn's first chunk: 8 tokens from position 21, keys from 14 on
    assert out.scheduled[0].num_new_tokens == 8
    assert s.num_released_blocks == 5 and s.block_table[:6] == [kept[2]] * 6  # next query 29: keys 22..29
    run_until_idle(sched)
    assert s.status == SequenceStatus.PARKED and len(s.token_ids) == 37
    sched.end_session(5)
    assert_no_leaks(sched)


def test_a_turn_ended_with_tokens_on_the_device_keeps_its_last_window():
    """With overlapped steps a token is launched before the one before it is read back; should
    the turn end then, the last known token is computed again, and its window must still be held."""
    sched, bm = windowed(num_blocks=8, max_num_tokens=16)
    s = sched_seq(15, 0, max_new_tokens=50, session_id=3)
    sched.add(s)
    sched.launched(sched.schedule(), [s])  # the prompt computed, its sampled token on the device
    sched.launched(sched.schedule(), [s])  # the next token launched too: two pending
    assert s.num_computed_tokens == 16 and len(s.token_ids) == 15 and s.num_pending_tokens == 2
    # The query at 16 would see keys 9..16 only, but token 14, computed again should the turn end
    # now, sees 7..14: block 1 stays.
    assert s.num_released_blocks == 1
    sched.finish(s, FinishReason.ABORT)
    assert s.num_computed_tokens == 14 and s.status == SequenceStatus.PARKED
    assert s.block_table[0] == s.block_table[1] and bm.blocks[s.block_table[1]].ref_count == 1
    s.start_turn([60, 61], SamplingParams(max_new_tokens=1))
    sched.add(s)
    _, out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 3  # token 14 again, then the new turn's two
    sched.end_session(3)
    assert_no_leaks(sched)


# ---- end to end ----------------------------------------------------------------------------------

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def mistrals(tmp_path_factory):
    """A tiny random Mistral v0.1 (every layer slides) for a given window, built once each."""
    built: dict[int, tuple[torch.nn.Module, Path]] = {}

    def get(window: int) -> tuple[torch.nn.Module, Path]:
        if window not in built:
            path = tmp_path_factory.mktemp(f"mistral_window_{window}") / "model"
            built[window] = save_tiny(MistralConfig(**TINY, sliding_window=window, **IDS), path, seed=3), path
        return built[window]

    return get


@pytest.fixture
def mistral(mistrals) -> tuple[torch.nn.Module, Path]:
    """The tiny Mistral with W = 8."""
    return mistrals(W)


def window_engine(path: Path, **kw) -> LLMEngine:
    config = dict(device="cpu", dtype="float32", cache_max_entry_count=24, block_size=BS, max_batch_size=4,
                  max_prefill_token_num=6) | kw
    return LLMEngine(path, EngineConfig(**config))


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def run(eng: LLMEngine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """Greedy ``n`` tokens for each prompt, all admitted at once; and the most blocks any one
    sequence held after a step."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    most = 0
    while eng.has_work:
        for o in eng.step():
            if o.token is not None:
                outs[o.request_id].append(o.token)
        most = max([most] + [held(s) for s in seqs if not s.is_finished])
        bm = eng.block_manager
        in_use = sum(held(s) for s in seqs if s.block_table)
        assert bm.num_free_blocks == bm.num_blocks - in_use
    return [outs[s.request_id] for s in seqs], most


@pytest.mark.parametrize("window,prefix,overlap", [(W, False, False), (3, True, False), (W, True, True)])
def test_engine_greedy_matches_generate_with_bounded_blocks(mistrals, window, prefix, overlap, poisoned_empty,
                                                            caplog):
    """Two 20-token prompts, 40 greedy tokens each, chunked prefill of 6 tokens, block size 4: the
    same tokens as ``generate`` while each sequence holds at most W / block_size + 1 blocks after a
    step (60 tokens would need 15). The KV cache starts NaN-filled: with a window narrower than a
    block, a released entry naming a block not yet all computed would show, since with the prefix
    cache on released (hashed) blocks are reused last and steps take never-written ones first.
    Overlapped steps (as on CUDA) release with a token still on the device."""
    hf, path = mistrals(window)
    prompts = [random_tokens(20, seed=11), random_tokens(20, seed=12)]
    with caplog.at_level("INFO", logger="conveyor.engine.llm_engine"):
        eng = window_engine(path, enable_prefix_caching=prefix, overlap_schedule=overlap)
    assert eng.block_manager.window == window
    assert sum(f"{window}-token sliding window" in r.getMessage() for r in caplog.records) == 1
    try:
        got, most = run(eng, prompts, 40)
        assert most <= -(-window // BS) + 1
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()
    assert got == [hf_greedy(hf, p, 40) for p in prompts]


def test_engine_triton_kernels_read_released_entries_safely(mistral, poisoned_empty) -> None:
    """The Triton kernels read whole tiles from the one holding the window's first key, so they
    meet released entries too (masked): on a NaN-filled cache, still the tokens of ``generate``."""
    from conveyor.kernels._triton import HAS_TRITON, TRITON_INTERPRETED

    if not HAS_TRITON or not TRITON_INTERPRETED:
        pytest.skip("needs Triton's interpreter in this process (a CPU engine)")
    hf, path = mistral
    prompts = [random_tokens(20, seed=31)]  # one, short: the Triton interpreter is slow
    eng = window_engine(path, kernels="triton", enable_prefix_caching=True)
    try:
        got, most = run(eng, prompts, 16)
        assert most <= W // BS + 1
    finally:
        eng.close()
    assert got == [hf_greedy(hf, p, 16) for p in prompts]


def test_engine_prefix_hits_after_release_stay_exact(mistral) -> None:
    """With the prefix cache on, the same prompt again finds the chain its first run released and
    left behind; after another prompt reused those blocks it is computed again; both exact."""
    hf, path = mistral
    prompt, other = random_tokens(20, seed=21), random_tokens(24, seed=22)
    ref = hf_greedy(hf, prompt, 30)
    eng = window_engine(path, enable_prefix_caching=True, cache_max_entry_count=16, max_prefill_token_num=32)
    try:
        bm = eng.block_manager
        assert run(eng, [prompt], 30)[0] == [ref]
        hits = bm.prefix_hit_tokens
        assert run(eng, [prompt], 30)[0] == [ref]
        assert bm.prefix_hit_tokens - hits == 16  # all the prompt's full blocks but the last token's
        assert run(eng, [other], 30)[0] == [hf_greedy(hf, other, 30)]
        hits = bm.prefix_hit_tokens
        assert run(eng, [prompt], 30)[0] == [ref]
        assert bm.prefix_hit_tokens - hits < 16  # the chain's head went to the other prompt
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        eng.close()


def test_engine_releases_nothing_where_a_layer_sees_everything(mistral, tmp_path: Path) -> None:
    """Gemma-style alternation (one sliding layer, one full): the full layer needs every key."""
    _, path = mistral
    raw = json.loads((path / "config.json").read_text())
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in path.iterdir():
        (mixed / f.name).write_bytes(f.read_bytes())
    (mixed / "config.json").write_text(json.dumps(raw | {"layer_types": ["sliding_attention", "full_attention"]}))
    eng = window_engine(mixed)
    try:
        assert eng.block_manager.window is None
        seqs = eng.add_request(random_tokens(20, seed=1), SamplingParams(max_new_tokens=10, temperature=0.0))
        most = 0
        while eng.has_work:
            eng.step()
            most = max(most, len(seqs.block_table) - seqs.num_released_blocks)
        assert seqs.num_released_blocks == 0 and most >= 7
    finally:
        eng.close()
