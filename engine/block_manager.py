"""Paged KV cache bookkeeping: ref-counted blocks, chain-hashed prefix reuse, LRU eviction.

Only ids and counters live here; the tensors are the model runner's. A full block's hash chains
its parent's hash with its token ids, so equal hashes mean equal prefixes. A freed block keeps
its hash and stays findable until the free list hands it out again; the free list is ordered
so that the block to reuse next comes first (blocks without a hash, then the least recently
freed, and within one sequence its tail before its head).

The first ``num_head_blocks`` blocks are kept for the first blocks of sequences while any is
free (their own free list, in the same order), and given out for other positions only when the
rest are gone: the cache layout keeps per-sequence state only for sequences that start in one
(``KVCacheLayout.reserved_head_blocks`` says how many; 0 for most layouts).

Where every layer attends through a sliding window of W tokens (``window``), a running sequence
gives back the blocks that lie wholly before the window of every query it can still bring
(``release_passed_blocks``), so a long generation holds about W / block_size + 1 blocks. A released
block goes back as a finished sequence's would: a hashed one stays findable until reused. Its
entry in the block table then names a block the sequence still holds (``Sequence.num_released_blocks``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from ..protocol.multimodal import ImageInput
from .multimodal import block_images
from .sequence import Sequence


class Block:
    """One block of ``block_size`` token slots."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks that hold a prompt's leading tokens."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


def chain_hash(parent: int | None, tokens: list[int], images: tuple[str, ...] = ()) -> int:
    """Hash of a full block given its parent block's hash (``chain_root`` for the first block)
    and the digests of the images its tokens show (``engine/multimodal.block_images``)."""
    return hash((parent, tuple(tokens), images)) if images else hash((parent, tuple(tokens)))


def chain_root(adapter_id: int) -> int | None:
    """The parent a first block chains from: None for the base model; for a LoRA adapter a key of
    its own, since its KV differs from the base model's for the same tokens."""
    return hash(("lora", adapter_id)) if adapter_id else None


class BlockManager:
    """Hands out blocks to sequences and finds cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_head_blocks: int = 0, window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window holds at least one token, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.num_head_blocks = min(num_head_blocks, num_blocks)
        # The window every layer slides with (``attention_windows.common_window``); None: some
        # layer sees the whole context, so no block is ever passed.
        self.window = window
        # The cache layout keys a sequence's state by its first block (``KVCacheLayout``): that
        # one is kept for the sequence's life, and releases start after it.
        self._first_releasable = 1 if self.num_head_blocks else 0
        self._free_head: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_head_blocks))
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_head_blocks, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # seq id -> (leading blocks of its table already hashed, chain hash of the last of them)
        self._num_hashed: dict[int, tuple[int, int | None]] = {}
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # ... of which were found

    @property
    def num_blocks(self) -> int:
        """Total blocks in the cache."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user (some may still hold a reusable cached prefix)."""
        return len(self._free) + len(self._free_head)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: list[int], count: bool = True, images: Seq[ImageInput] = (),
                    adapter_id: int = 0) -> PrefixMatch:
        """The longest run of cached full blocks matching the start of ``token_ids`` (computed
        with LoRA adapter ``adapter_id``, 0: none).

        At least one token is always left uncomputed: the last prompt token must run through
        the model to give the logits of the first generated token. ``count=False`` leaves the
        hit statistics alone (a caller that may retry counts once, with ``count_prefix``).
        """
        if not self.enable_prefix_caching:
            return PrefixMatch()
        bs, parent, found = self.block_size, chain_root(adapter_id), []
        for i in range((len(token_ids) - 1) // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs], block_images(images, i * bs, (i + 1) * bs))
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        match = PrefixMatch(tuple(found), len(found) * bs)
        if count:
            self.count_prefix(len(token_ids), match)
        return match

    def count_prefix(self, num_query_tokens: int, match: PrefixMatch) -> None:
        """Add one lookup to the prefix-cache statistics."""
        if self.enable_prefix_caching:
            self.prefix_query_tokens += num_query_tokens
            self.prefix_hit_tokens += match.num_tokens

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch = PrefixMatch()) -> bool:
        """Whether ``allocate`` would succeed."""
        return self._blocks_to_take(seq, num_new_tokens, prefix) <= self.num_free_blocks

    def _blocks_to_take(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> int:
        total = seq.num_computed_tokens + prefix.num_tokens + num_new_tokens
        fresh = self.blocks_needed(total) - len(seq.block_table) - len(prefix.block_ids)
        # Reusing a cached block that nobody holds takes it off the free list too.
        revived = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
        return max(fresh, 0) + revived

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch = PrefixMatch()) -> bool:
        """Give ``seq`` the prefix blocks and enough fresh blocks for ``num_new_tokens`` more tokens.

        Returns False (and changes nothing) when the free list is too short.
        """
        if not self.can_allocate(seq, num_new_tokens, prefix):
            return False
        for block_id in prefix.block_ids:
            self._take(block_id)
        seq.block_table.extend(prefix.block_ids)
        seq.num_computed_tokens += prefix.num_tokens
        seq.num_cached_tokens += prefix.num_tokens
        if prefix.block_ids:
            last_hash = self.blocks[prefix.block_ids[-1]].block_hash
            self._num_hashed[seq.seq_id] = (len(seq.block_table), last_hash)
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_needed(total):
            preferred, other = (self._free_head, self._free) if not seq.block_table else (self._free, self._free_head)
            block_id = next(iter(preferred or other))
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict the cached prefix it held
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_list(block_id)[block_id]
        block.ref_count += 1

    def _free_list(self, block_id: int) -> OrderedDict[int, None]:
        return self._free_head if block_id < self.num_head_blocks else self._free

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            free = self._free_list(block_id)
            free[block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                free.move_to_end(block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; its KV counts as not computed any more."""
        lo = self._first_releasable
        held = seq.block_table[:lo] + seq.block_table[lo + seq.num_released_blocks :]
        for block_id in reversed(held):
            self._unref(block_id)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0
        self._num_hashed.pop(seq.seq_id, None)

    def release_passed_blocks(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq`` that no query it can still bring will see (only with
        a ``window``); called whenever its counters move."""
        if self.window is None:
            return
        bs, lo = self.block_size, self._first_releasable
        # The earliest query it can still bring: its next uncomputed token or, should the turn end
        # with tokens still on the device, the last known token, computed again then
        # (``Scheduler._drop_pending``). A session's next turn starts there too.
        first_query = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
        # That query sees the keys first_query - W + 1 on: the blocks wholly before them are passed.
        end = (first_query - self.window + 1) // bs
        # The released entries will name block ``end``: the reference attention still gathers them
        # and masks them to weight 0, which a NaN would still spoil. So that block must be finite in
        # every slot: held by the sequence and wholly before first_query, so all computed. Not the
        # released block itself: once handed out it is another sequence's, partly rewritten or not.
        # Binds only when W <= block_size.
        end = min(end, first_query // bs - 1)
        if self.enable_prefix_caching:
            # Hashed first: cache_full_blocks would otherwise publish the block a released entry
            # names under the released block's hash.
            end = min(end, self._num_hashed.get(seq.seq_id, (0, None))[0])
        start = lo + seq.num_released_blocks
        if end <= start:
            return
        table = seq.block_table
        for block_id in reversed(table[start:end]):  # tail first, as free() goes
            self._unref(block_id)
        # A new list: a step already built may still hold the old one.
        seq.block_table = table[:lo] + [table[end]] * (end - lo) + table[end:]
        seq.num_released_blocks = end - lo

    def switch_adapter(self, seq: Sequence, adapter_id: int) -> None:
        """A session's next turn runs with another LoRA adapter: its blocks from here on chain
        from a key that names the switch, so that no request of either adapter alone finds them."""
        if seq.seq_id in self._num_hashed:
            start, parent = self._num_hashed[seq.seq_id]
            self._num_hashed[seq.seq_id] = (start, hash((parent, "lora switch", adapter_id)))
        seq.adapter_id = adapter_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # The parent hash is carried along, not read off the previous block: a block whose content
        # was already cached stays unhashed, and its successors must still chain its true hash.
        start, parent = self._num_hashed.get(seq.seq_id, (0, chain_root(seq.adapter_id)))
        # Only blocks whose token ids are all on the host: a token still on the device cannot be
        # hashed yet; its block is published when the token is read back.
        end = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bs, len(seq.block_table))
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs],
                                block_images(seq.images, i * bs, (i + 1) * bs))
            if block.block_hash is None and parent not in self._cached:
                block.block_hash = parent
                self._cached[parent] = block.block_id
            # A second block with content already cached stays unhashed: the cache keeps one copy.
        if end > start:
            self._num_hashed[seq.seq_id] = (end, parent)
