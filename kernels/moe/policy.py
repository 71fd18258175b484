"""Tile choices of the fused-MoE GEMMs: tuned per expert shape and token count where the
repository holds a tuning for this GPU, else a table by rows per expert.

Tunings live in ``configs/<GPU name>/E<experts>_k<top_k>_H<hidden>_I<inter>_<dtype>.json``
(``inter``: one rank's slice of the experts' width), written by ``python -m
benchmarks.tune_moe``: for each token count measured, the ``BLOCK_M`` of the expert layout and
the gate/up and down kernels' own tiles, each the fastest of a sweep replayed from CUDA graphs.
A call takes the entry of the nearest measured token count (by ratio), so users never tune at
start-up, as vLLM's saved configs spare theirs.

The fallback table: a decode step gives each expert a handful of pairs (``T*k/E`` rows on
average): ``BLOCK_M`` 16 wastes the least padding and a long ``BLOCK_K`` keeps the weight stream,
which is the whole cost, in few wide loads. Prefill gives experts hundreds of rows and the
products become compute-bound: larger square-ish tiles. The gate/up pass holds two accumulators
(gate and up), so its effective output tile is ``2*BLOCK_N`` wide; the table keeps ``BLOCK_N`` at
64 for that reason.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Tiles:
    """One grouped GEMM's tiles past ``BLOCK_M`` (which both GEMMs share: it is the layout's)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    gate_up: Tiles
    down: Tiles

    @classmethod
    def uniform(cls, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> MoeConfig:
        """The same tiles for both GEMMs."""
        tiles = Tiles(block_n, block_k, num_warps, num_stages)
        return cls(block_m, tiles, tiles)

    def label(self) -> str:
        """``m16 gate_up 64x128 w4 s3 / down 64x128 w4 s3`` (reports)."""
        def one(t: Tiles) -> str:
            return f"{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}"
        return f"m{self.block_m} gate_up {one(self.gate_up)} / down {one(self.down)}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> MoeConfig:
        return cls(int(d["block_m"]), Tiles(**d["gate_up"]), Tiles(**d["down"]))


# (most rows per expert on average, config): the first entry that holds the shape's average.
TABLE: tuple[tuple[float, MoeConfig], ...] = (
    (16, MoeConfig.uniform(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (96, MoeConfig.uniform(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (512, MoeConfig.uniform(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (float("inf"), MoeConfig.uniform(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)),
)


def config_path(gpu: str, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype) -> Path:
    """Where the tuning of this shape on ``gpu`` (``torch.cuda.get_device_name``) lives."""
    dtype_name = str(dtype).removeprefix("torch.")
    return CONFIG_DIR / gpu.replace(" ", "_") / f"E{num_experts}_k{top_k}_H{hidden}_I{inter}_{dtype_name}.json"


@functools.cache
def _gpu_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _tuned(path: Path) -> tuple[tuple[int, MoeConfig], ...]:
    """(token count, config) pairs of a tuning file, sorted; () when there is none."""
    if not path.is_file():
        return ()
    entries = json.loads(path.read_text())["configs"]
    return tuple(sorted((int(m), MoeConfig.from_json(c)) for m, c in entries.items()))


def table_config(num_tokens: int, top_k: int, num_experts: int, element_size: int = 2) -> MoeConfig:
    """The fallback table's tiles. fp32 (``element_size`` 4) halves the stages so the pipelined
    tiles still fit in shared memory."""
    rows = num_tokens * top_k / max(num_experts, 1)
    cfg = next(c for limit, c in TABLE if rows <= limit)
    if element_size >= 4:
        cfg = MoeConfig.uniform(cfg.block_m, cfg.gate_up.block_n, min(cfg.gate_up.block_k, 64),
                                cfg.gate_up.num_warps, 2)
    return cfg


def moe_config(num_tokens: int, top_k: int, num_experts: int, element_size: int = 2, *,
               hidden: int | None = None, inter: int | None = None, dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> MoeConfig:
    """The tiles for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts: the
    saved tuning's entry nearest ``num_tokens`` for this shape on this GPU, else the table."""
    if device is not None and device.type == "cuda" and hidden and inter and dtype is not None:
        path = config_path(_gpu_name(device.index), num_experts, top_k, hidden, inter, dtype)
        tuned = _tuned(path)
        if tuned:
            return min(tuned, key=lambda e: abs(math.log(e[0]) - math.log(max(num_tokens, 1))))[1]
    return table_config(num_tokens, top_k, num_experts, element_size)
