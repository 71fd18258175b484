"""BlockManager on a simulated cache (no model): exact block ids, ref counts, free-list and eviction order."""

from __future__ import annotations

import pytest

from conveyor.engine.block_manager import BlockManager, PrefixMatch, chain_hash
from conveyor.protocol.sampling import SamplingParams
from conveyor.engine.sequence import Sequence

BS = 4


def seq(tokens, seq_id=None) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), seq_id=seq_id)


def free_order(bm: BlockManager) -> list[int]:
    """The free list, next block to hand out first."""
    return list(bm._free)


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


NO_PREFIX = PrefixMatch()  # frozen: one shared default is safe


def compute(bm: BlockManager, s: Sequence, n: int, prefix: PrefixMatch = NO_PREFIX) -> None:
    """Allocate for ``n`` more tokens, then mark them computed and publish full blocks (one step)."""
    assert bm.allocate(s, n, prefix)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)


def prefill(bm: BlockManager, s: Sequence) -> None:
    prefix = bm.find_prefix(s.token_ids)
    compute(bm, s, s.num_tokens - prefix.num_tokens, prefix)


def test_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_blocks_needed_and_usage():
    bm = BlockManager(8, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.num_blocks == 8 and bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.allocate(seq(range(8)), 8)
    assert bm.num_free_blocks == 6 and bm.usage == pytest.approx(0.25)


def test_fresh_blocks_in_order():
    bm = BlockManager(8, BS)
    a, b = seq(range(10)), seq(range(100, 104))
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert a.num_computed_tokens == 0  # allocate reserves room, the step computes
    assert bm.allocate(b, 4)
    assert b.block_table == [3]
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2)  # 12 tokens still fit in 3 blocks
    assert a.block_table == [0, 1, 2]
    assert bm.allocate(a, 3)  # 13 tokens: one more block
    assert a.block_table == [0, 1, 2, 4]
    assert refs(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert free_order(bm) == [5, 6, 7]
    assert bm.num_free_blocks == 3


def test_free_unhashed_blocks_go_to_the_front():
    bm = BlockManager(8, BS)
    a, b = seq(range(12)), seq(range(100, 108))
    assert bm.allocate(a, 12) and bm.allocate(b, 8)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    a.num_computed_tokens = 12
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert free_order(bm) == [0, 1, 2, 5, 6, 7]
    bm.free(b)
    assert free_order(bm) == [3, 4, 0, 1, 2, 5, 6, 7]
    assert refs(bm) == [0] * 8
    c = seq(range(200, 216))
    assert bm.allocate(c, 16)
    assert c.block_table == [3, 4, 0, 1]


def test_free_hashed_blocks_go_to_the_back_tail_first():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq(range(14))  # 3 full blocks and a partial one
    compute(bm, a, 14)
    assert a.block_table == [0, 1, 2, 3]
    assert [bm.blocks[i].block_hash is not None for i in range(4)] == [True, True, True, False]
    bm.free(a)
    # The partial block holds nothing reusable: first. The hashed ones last, tail before head.
    assert free_order(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    # ... so fresh allocations use up the unhashed blocks before evicting any cached prefix.
    b = seq(range(100, 120))
    assert bm.allocate(b, 20)
    assert b.block_table == [3, 4, 5, 6, 7]
    assert bm.find_prefix(list(range(14))).block_ids == (0, 1, 2)


def test_shared_prefix_ref_counts():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    p = list(range(12))
    a = seq(p)
    prefill(bm, a)
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    b = seq(p[:8] + [50, 51, 52, 53, 54])
    prefix = bm.find_prefix(b.token_ids)
    assert prefix == PrefixMatch((0, 1), 8)
    assert bm.allocate(b, 5, prefix)
    assert b.block_table == [0, 1, 3, 4]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert refs(bm) == [2, 2, 1, 1, 1, 0, 0, 0]
    bm.free(a)
    assert refs(bm) == [1, 1, 0, 1, 1, 0, 0, 0]
    assert free_order(bm) == [5, 6, 7, 2]  # only the block nobody else holds
    b.num_computed_tokens = 13
    bm.cache_full_blocks(b)  # block 3 is full now
    bm.free(b)
    assert refs(bm) == [0] * 8
    # Tail first: 4 (partial, unhashed) to the front; 3, 1, 0 (hashed) to the back in that order.
    assert free_order(bm) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_find_prefix_full_blocks_only():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    p = list(range(10))  # 2 full blocks and 2 tokens
    a = seq(p)
    prefill(bm, a)
    assert [b.block_hash is not None for b in bm.blocks[:3]] == [True, True, False]
    assert bm.find_prefix(p + [99]) == PrefixMatch((0, 1), 8)
    assert bm.find_prefix(p[:6] + [77, 77, 77]) == PrefixMatch((0,), 4)  # block 1 differs
    assert bm.find_prefix([0, 1, 2, 77, 4, 5, 6, 7, 8]) == PrefixMatch()  # block 0 differs
    assert bm.find_prefix(p[:3]) == PrefixMatch()  # not even one full block
    assert bm.find_prefix([]) == PrefixMatch()


def test_find_prefix_chain_semantics():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    prefill(bm, seq(x + y + [0]))
    assert bm.find_prefix(x + y + [0]).block_ids == (0, 1)
    assert bm.find_prefix(z + y + [0]) == PrefixMatch()  # y after another block is another prefix
    assert bm.find_prefix(y + [0]) == PrefixMatch()  # y as the first block was never cached
    assert bm.blocks[1].block_hash == chain_hash(chain_hash(None, x), y)


def test_find_prefix_leaves_one_token_uncomputed():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    p = list(range(12))
    prefill(bm, seq(p + [12]))  # caches 3 full blocks
    assert bm.find_prefix(p) == PrefixMatch((0, 1), 8)  # exactly 3 blocks: 2 hit
    assert bm.find_prefix(p + [12]) == PrefixMatch((0, 1, 2), 12)
    assert bm.find_prefix(p[:4]) == PrefixMatch()  # exactly 1 block: none


def test_freed_hashed_block_findable_until_reused_lru():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    pa, pb = list(range(9)), list(range(100, 109))
    a, b = seq(pa), seq(pb)
    prefill(bm, a)
    prefill(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    assert free_order(bm) == [5, 2, 1, 0, 4, 3]
    assert bm.find_prefix(pa).block_ids == (0, 1)
    assert bm.find_prefix(pb).block_ids == (3, 4)
    c = seq(range(200, 212))
    assert bm.allocate(c, 12)  # 3 fresh: two unhashed, then a's tail block
    assert c.block_table == [5, 2, 1]
    assert bm.blocks[1].block_hash is None
    assert bm.find_prefix(pa).block_ids == (0,)
    assert bm.find_prefix(pb).block_ids == (3, 4)
    d = seq(range(300, 304))
    assert bm.allocate(d, 4)
    assert d.block_table == [0]
    assert bm.find_prefix(pa) == PrefixMatch()
    assert bm.find_prefix(pb).block_ids == (3, 4)
    e = seq(range(400, 408))
    assert bm.allocate(e, 8)
    assert e.block_table == [4, 3]  # b's tail before its head
    assert bm.find_prefix(pb) == PrefixMatch()
    assert bm._cached == {}


def test_reviving_a_freed_block_refreshes_its_lru_position():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    pa, pb = [1, 1, 1, 1, 0], [2, 2, 2, 2, 0]
    a, b = seq(pa), seq(pb)
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert free_order(bm) == [3, 1, 0, 2]
    a2 = seq(pa)
    prefill(bm, a2)  # revives block 0 (a's prefix) and takes 3 for the last token
    assert a2.block_table == [0, 3] and a2.num_cached_tokens == 4
    bm.free(a2)
    assert free_order(bm) == [3, 1, 2, 0]  # block 0 is now the most recently freed
    c = seq(range(100, 108))
    assert bm.allocate(c, 8)
    assert c.block_table == [3, 1]
    assert bm.allocate(seq(range(200, 204)), 4)  # evicts b's block before a's
    assert bm.find_prefix(pb) == PrefixMatch()
    assert bm.find_prefix(pa).block_ids == (0,)


def test_allocate_short_changes_nothing():
    bm = BlockManager(4, BS)
    a = seq(range(12))
    assert bm.allocate(a, 12)
    b = seq(range(100, 108))
    before = (free_order(bm), refs(bm))
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert (free_order(bm), refs(bm)) == before
    assert bm.can_allocate(b, 4) and bm.allocate(b, 4)
    assert b.block_table == [3]


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    p = list(range(9))
    a = seq(p)
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert free_order(bm) == [2, 3, 1, 0]
    c = seq(range(100, 104))
    assert bm.allocate(c, 4)
    assert c.block_table == [2]
    # 16 tokens: 2 cached blocks with ref 0 (taken off the free list too) + 2 fresh = 4 > 3 free.
    b = seq(p[:8] + list(range(50, 58)))
    prefix = bm.find_prefix(b.token_ids)
    assert prefix == PrefixMatch((0, 1), 8)
    assert not bm.can_allocate(b, 8, prefix)
    before = (free_order(bm), refs(bm), dict(bm._cached))
    assert not bm.allocate(b, 8, prefix)
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert (free_order(bm), refs(bm), bm._cached) == before
    # 12 tokens: 2 revived + 1 fresh = 3: fits exactly.
    b = seq(p[:8] + list(range(50, 54)))
    prefix = bm.find_prefix(b.token_ids)
    assert bm.can_allocate(b, 4, prefix) and bm.allocate(b, 4, prefix)
    assert b.block_table == [0, 1, 3]
    assert refs(bm) == [1, 1, 1, 1] and free_order(bm) == []
    # A prefix block someone holds costs nothing more.
    d = seq(p[:8] + [7])
    prefix = bm.find_prefix(d.token_ids)
    assert prefix.block_ids == (0, 1)
    assert bm.can_allocate(d, 0, prefix)
    assert not bm.can_allocate(d, 1, prefix)  # the 9th token needs a fresh block


def test_cache_full_blocks_incrementally_during_decode():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq([10, 11, 12, 13, 14, 15])
    compute(bm, a, 6)
    assert a.block_table == [0, 1]
    h0 = chain_hash(None, [10, 11, 12, 13])
    assert [bm.blocks[0].block_hash, bm.blocks[1].block_hash] == [h0, None]
    a.token_ids.append(16)
    compute(bm, a, 1)  # 7 computed: block 1 not full yet
    assert a.block_table == [0, 1] and bm.blocks[1].block_hash is None
    a.token_ids.append(17)
    compute(bm, a, 1)  # 8 computed: block 1 full
    assert bm.blocks[1].block_hash == chain_hash(h0, [14, 15, 16, 17])
    assert bm.find_prefix(a.token_ids + [18]).block_ids == (0, 1)
    a.token_ids.append(18)
    compute(bm, a, 1)
    assert a.block_table == [0, 1, 2] and bm.blocks[2].block_hash is None
    # Hashing counts computed tokens only, not tokens merely known.
    a.token_ids.append(19)
    a.token_ids.append(20)
    a.token_ids.append(21)
    bm.allocate(a, 3)
    bm.cache_full_blocks(a)
    assert bm.blocks[2].block_hash is None
    a.num_computed_tokens += 3
    bm.cache_full_blocks(a)
    assert bm.blocks[2].block_hash == chain_hash(bm.blocks[1].block_hash, [18, 19, 20, 21])


def test_duplicate_content_keeps_one_cached_copy():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    p = list(range(9))
    a, b = seq(p), seq(p)
    # Both admitted before either published its blocks, so neither hit.
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert [bm.blocks[i].block_hash is not None for i in range(6)] == [True, True, False, False, False, False]
    assert bm.find_prefix(p).block_ids == (0, 1)
    bm.free(b)
    assert free_order(bm) == [3, 4, 5, 6, 7]  # the copies are reused first
    bm.free(a)
    assert free_order(bm) == [2, 3, 4, 5, 6, 7, 1, 0]


def test_block_after_a_duplicate_chains_the_true_hash():
    """A block whose content is already cached stays unhashed; the next block of the same sequence,
    hashed in a later step, must chain the true prefix, not start a new chain."""
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    x, y, w = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a, b = seq(x + y + [0]), seq(x + w + [0])
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b.num_computed_tokens = 4  # chunked: block 0 (a duplicate of a's) this step ...
    bm.cache_full_blocks(b)
    assert bm.blocks[3].block_hash is None
    b.num_computed_tokens = 8  # ... block 1 the next
    bm.cache_full_blocks(b)
    assert bm.blocks[4].block_hash == chain_hash(chain_hash(None, x), w)
    assert bm.find_prefix(x + w + [0]).block_ids == (0, 4)
    assert bm.find_prefix(w + [0]) == PrefixMatch()  # w is no first block
    assert bm.find_prefix(y + [0]) == PrefixMatch()


def test_hashing_continues_after_a_prefix_hit():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    x, y, w = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    prefill(bm, seq(x + y + [0]))
    b = seq(x + y + w + [0])
    prefix = bm.find_prefix(b.token_ids)
    assert prefix.block_ids == (0, 1)
    compute(bm, b, 5, prefix)
    assert b.block_table == [0, 1, 3, 4]
    assert bm.blocks[3].block_hash == chain_hash(chain_hash(chain_hash(None, x), y), w)
    assert bm.find_prefix(x + y + w + [0]).block_ids == (0, 1, 3)


def test_prefix_stats():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    p = list(range(9))
    bm.find_prefix(p)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (9, 0)
    prefill(bm, seq(p))
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (18, 0)
    bm.find_prefix(p + [1, 2])
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (29, 8)
    bm.find_prefix([7, 7, 7, 7, 7])
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (34, 8)


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    p = list(range(9))
    a = seq(p)
    prefill(bm, a)
    assert all(b.block_hash is None for b in bm.blocks) and bm._cached == {}
    assert bm.find_prefix(p + [1]) == PrefixMatch()
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (0, 0)
    bm.free(a)
    assert free_order(bm) == list(range(8))


def test_head_blocks_go_to_first_blocks_while_any_is_free():
    """The first ``num_head_blocks`` blocks (a quantized cache's key-centre rows) start
    sequences; other positions take them only when the rest are gone, and freed ones return to
    their own list."""
    bm = BlockManager(8, BS, num_head_blocks=2)
    a, b, c = seq(range(10)), seq(range(100, 109)), seq(range(200, 205))
    assert bm.allocate(a, 10) and a.block_table == [0, 2, 3]
    assert bm.allocate(b, 9) and b.block_table == [1, 4, 5]
    assert bm.allocate(c, 5) and c.block_table == [6, 7]  # no head block left: c starts elsewhere
    bm.free(a)
    assert list(bm._free_head) == [0] and free_order(bm) == [2, 3] and bm.num_free_blocks == 3
    for s in (b, c):
        bm.free(s)
    assert bm.num_free_blocks == 8 and refs(bm) == [0] * 8
    small = BlockManager(4, BS, num_head_blocks=2)
    d = seq(range(13))
    assert small.allocate(d, 13) and d.block_table == [0, 2, 3, 1]  # a head block last, for a later position
