"""Sorting the (token, slot) pairs by expert for the grouped GEMM (the package doc).

``moe_align(topk_ids, num_experts, block_m)`` lays the ``T*k`` pairs out expert by expert, each
expert's run padded to a multiple of ``block_m`` so that every ``block_m`` tile of the layout
belongs to one expert. Everything stays on the device: no host sync, so a decode step can be
captured in a CUDA graph, and every size depends on ``T``, ``k`` and ``E`` alone, so the GEMMs'
grids are sized on the host and the programs past the used tiles return at once.

Two implementations of the same layout:

* up to ``KERNEL_MAX_PAIRS`` pairs (decode and small prefills), two Triton kernels:
  ``_count_kernel`` (one program) walks the pairs in chunks, counting each expert's pairs and
  saving the counts before each chunk, then lays out the tiles; ``_scatter_kernel`` (a program per
  chunk) places each pair at its expert's first row + the pairs of that expert in earlier chunks
  + those before it in its own chunk, and writes the padding rows. A decode step used to spend
  ~30 small torch launches per layer here, more than its expert GEMMs (Qwen3-30B-A3B, batch 1);
* past it, torch ops (a stable sort, a scatter, cumulative sums, a ``searchsorted``), whose
  launches are noise next to a prefill's GEMMs, while the one-program count would grow with T.
"""

from __future__ import annotations

import torch

from .._triton import cdiv, jit, next_pow2, tl, triton_takes

# Pairs up to which the Triton kernels lay the pairs out (the module doc).
KERNEL_MAX_PAIRS = 4096
_CHUNK = 64  # most pairs per chunk of both kernels (the rank within a chunk is a CHUNK x CHUNK compare)
_ROWS = 256  # layout rows a scatter program pads


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most ``block_m`` tiles ``num_pairs`` pairs can need: each expert in use wastes at most
    ``block_m - 1`` padding rows, and at most ``min(E, pairs)`` experts are in use."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m if num_pairs else 0


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [tiles*block_m] int32, tile_expert [tiles] int32,
    tiles_used [1] int32), ``tiles = max_tiles(T*k, E, block_m)``.

    ``sorted_pairs`` holds pair indices ``t*k + j``, expert 0's first, each expert's in pair
    order; padding rows hold ``T*k`` (a row no pair has, which the kernels mask). ``tile_expert[i]``
    is the expert of tile ``i``, -1 past the used tiles. Ids outside [0, E) (experts of other
    ranks) are left out."""
    num_pairs = topk_ids.numel()
    if 0 < num_pairs <= KERNEL_MAX_PAIRS and triton_takes("moe_align", (topk_ids,), _problem, topk_ids):
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)


def _problem(topk_ids: torch.Tensor) -> str | None:
    if topk_ids.dtype not in (torch.int32, torch.int64):
        return f"topk_ids dtype {topk_ids.dtype} (int32 or int64)"
    return None


@jit
def _count_kernel(
    ids, num_pairs, num_experts, num_tiles, counts, first_row, chunk_base, tile_expert, used,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        e = tl.where(e < num_experts, e, -1)  # other ranks' experts count nowhere
        # Each chunk's scatter program starts its experts where the chunks before it ended.
        tl.store(chunk_base + (start // CHUNK) * E_PAD + experts, running)
        running += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    real = experts < num_experts
    tiles_of = tl.where(real, (running + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles_of, axis=0)  # inclusive: expert e's tiles end at tile_end[e]
    tl.store(counts + experts, running)
    tl.store(first_row + experts, (tile_end - tiles_of) * BLOCK_M)
    total = tl.sum(tiles_of, axis=0)
    tl.store(used, total)
    for t0 in range(0, num_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        # Tile t's expert: how many experts' tiles end at or before it (tile_end never decreases).
        owner = tl.sum(((tile_end[None, :] <= t[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(tile_expert + t, tl.where(t < total, owner, -1), mask=t < num_tiles)


@jit
def _scatter_kernel(
    ids, num_pairs, num_experts, num_rows, counts, first_row, chunk_base, tile_expert, sorted_pairs,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid * CHUNK < num_pairs:
        lane = tl.arange(0, CHUNK)
        offs = pid * CHUNK + lane
        e = tl.load(ids + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        ok = (offs < num_pairs) & (e >= 0) & (e < num_experts)
        # Stable: a pair follows the pairs of its expert earlier in its chunk.
        rank = tl.sum(((e[None, :] == e[:, None]) & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        safe = tl.where(ok, e, 0)
        base = tl.load(chunk_base + pid * E_PAD + safe, mask=ok, other=0)
        row = tl.load(first_row + safe, mask=ok, other=0) + base + rank
        tl.store(sorted_pairs + row, offs, mask=ok)
    if pid * ROWS < num_rows:
        # Padding rows (past an expert's pairs in its last tile, or in the unused tiles): T*k.
        # Disjoint from the rows the pairs take, so no program waits on another.
        rows = pid * ROWS + tl.arange(0, ROWS)
        in_layout = rows < num_rows
        owner = tl.load(tile_expert + rows // BLOCK_M, mask=in_layout, other=-1)
        safe = tl.where(owner >= 0, owner, 0)
        start = tl.load(first_row + safe, mask=in_layout, other=0)
        count = tl.load(counts + safe, mask=in_layout, other=0)
        pad = in_layout & ((owner < 0) | (rows - start >= count))
        tl.store(sorted_pairs + rows, tl.zeros([ROWS], dtype=tl.int32) + num_pairs, mask=pad)


def moe_align_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align`` by the two Triton kernels (the module doc): two launches, no host sync."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    tiles = max_tiles(num_pairs, num_experts, block_m)
    rows = tiles * block_m
    e_pad = next_pow2(num_experts)
    # A decode step's few pairs take a chunk of their own size (the count's one-hot is CHUNK x E_PAD).
    chunk = min(_CHUNK, max(16, next_pow2(num_pairs)))
    chunks = cdiv(num_pairs, chunk)
    i32 = dict(dtype=torch.int32, device=device)
    counts, first_row = torch.empty(e_pad, **i32), torch.empty(e_pad, **i32)
    chunk_base = torch.empty(chunks, e_pad, **i32)
    tile_expert, used = torch.empty(tiles, **i32), torch.empty(1, **i32)
    sorted_pairs = torch.empty(rows, **i32)
    _count_kernel[(1,)](ids, num_pairs, num_experts, tiles, counts, first_row, chunk_base, tile_expert, used,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    _scatter_kernel[(max(chunks, cdiv(rows, _ROWS)),)](
        ids, num_pairs, num_experts, rows, counts, first_row, chunk_base, tile_expert, sorted_pairs,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, ROWS=_ROWS, num_warps=4)
    return sorted_pairs, tile_expert, used


def moe_align_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align`` by torch ops (the module doc)."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    tiles = max_tiles(num_pairs, num_experts, block_m)
    rows = tiles * block_m
    ids = topk_ids.reshape(-1).long()
    # Experts another rank holds go to bucket E, which gets no tile.
    keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    # scatter_add_ rather than bincount: CUDA bincount reads the maximum back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    # Bucket E gets no tile. A mask product, not ``tiles_of[E] = 0``: that assignment copies a CPU
    # scalar into the device tensor, which CUDA-graph capture refuses.
    real_bucket = torch.arange(num_experts + 1, device=device) < num_experts
    tiles_of = torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * real_bucket
    tile_end = torch.cumsum(tiles_of, 0)  # inclusive: expert e's tiles end at tile_end[e]
    first_row = (tile_end - tiles_of) * block_m  # where expert e's run starts in the layout
    first_sorted = torch.cumsum(counts, 0) - counts  # where expert e's pairs start once sorted
    # Stable: within an expert the pairs keep token order (coalesced-ish gathers, deterministic).
    sorted_keys, order = torch.sort(keys, stable=True)
    rank = torch.arange(num_pairs, device=device) - first_sorted[sorted_keys]
    dest = first_row[sorted_keys] + rank
    dest = torch.where(sorted_keys < num_experts, dest, rows)  # left-out pairs land past the end
    sorted_pairs = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    tile_index = torch.arange(tiles, device=device)
    tile_expert = torch.searchsorted(tile_end[:num_experts], tile_index, right=True)
    used = tile_end[num_experts - 1 : num_experts] if num_experts else tile_end[:1]
    tile_expert = torch.where(tile_index < used, tile_expert, -1).to(torch.int32)
    return sorted_pairs[:rows], tile_expert, used.to(torch.int32)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """A host loop of the same layout (tests): (sorted_pairs, tile_expert) of the used tiles."""
    flat = topk_ids.reshape(-1).tolist()
    pairs: list[int] = []
    experts: list[int] = []
    for e in range(num_experts):
        mine = [p for p, i in enumerate(flat) if i == e]
        if not mine:
            continue
        n = cdiv(len(mine), block_m)
        pairs += mine + [len(flat)] * (n * block_m - len(mine))
        experts += [e] * n
    return pairs, experts
