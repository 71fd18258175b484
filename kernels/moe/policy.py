"""Tile choices of the fused-MoE GEMMs, by how many rows each expert gets.

A decode step gives each expert a handful of pairs (``T*k/E`` rows on average): ``BLOCK_M`` 16
wastes the least padding and a long ``BLOCK_K`` keeps the weight stream, which is the whole cost,
in few wide loads. Prefill gives experts hundreds of rows and the products become compute-bound:
larger square-ish tiles. The gate/up pass holds two accumulators (gate and up), so its effective
output tile is ``2*BLOCK_N`` wide; the table keeps ``BLOCK_N`` at 64 for that reason.

These are hand-picked defaults for Hopper (H100/H200), not measured per shape. Autotuning per
(E, H, I, dtype, rows) with the results saved in the repository, as vLLM's JSON configs do, is a
later step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (most rows per expert on average, config): the first entry that holds the shape's average.
TABLE: tuple[tuple[float, MoeConfig], ...] = (
    (16, MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (96, MoeConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (512, MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (float("inf"), MoeConfig(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)),
)


def moe_config(num_tokens: int, top_k: int, num_experts: int, element_size: int = 2) -> MoeConfig:
    """The tiles for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts. fp32
    (``element_size`` 4) halves the stages so the pipelined tiles still fit in shared memory."""
    rows = num_tokens * top_k / max(num_experts, 1)
    cfg = next(c for limit, c in TABLE if rows <= limit)
    if element_size >= 4:
        cfg = MoeConfig(cfg.block_m, cfg.block_n, min(cfg.block_k, 64), cfg.num_warps, 2)
    return cfg
