"""Sorting the (token, slot) pairs by expert for the grouped GEMM (the package doc).

``moe_align(topk_ids, num_experts, block_m)`` lays the ``T*k`` pairs out expert by expert, each
expert's run padded to a multiple of ``block_m`` so that every ``block_m`` tile of the layout
belongs to one expert. Everything stays on the device (a stable sort, a scatter, cumulative sums,
a ``searchsorted``): no host sync, so a decode step can be captured in a CUDA graph, and every
size depends on ``T``, ``k`` and ``E`` alone, so the GEMMs' grids are sized on the host and the
programs past the used tiles return at once.
"""

from __future__ import annotations

import torch

from .._triton import cdiv


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most ``block_m`` tiles ``num_pairs`` pairs can need: each expert in use wastes at most
    ``block_m - 1`` padding rows, and at most ``min(E, pairs)`` experts are in use."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m if num_pairs else 0


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [tiles*block_m] int32, tile_expert [tiles] int32,
    tiles_used [1] int32), ``tiles = max_tiles(T*k, E, block_m)``.

    ``sorted_pairs`` holds pair indices ``t*k + j``, expert 0's first; padding rows hold ``T*k``
    (a row no pair has, which the kernels mask). ``tile_expert[i]`` is the expert of tile ``i``,
    -1 past the used tiles. Ids outside [0, E) (experts of other ranks) are left out."""
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
