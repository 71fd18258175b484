"""Launch policy of the W4A16 kernels: which path a row count takes, the tile choices of each
kernel (``GemvConfig`` / ``GemmConfig``, frozen values that tests and benchmarks pass in) and the
K splits that fill the SMs."""

from dataclasses import dataclass

from .._triton import cdiv, next_pow2

# From this many rows on, the Triton path writes the dense weight and lets cuBLAS multiply: the
# fused kernel dequantizes the weight once per 64-row tile, a cost that grows with M, while the
# dense write and read cost a fixed ~K * N * 4 bytes. On an H200 (Llama-2-7B, group 128) the fused
# kernel took 37-71 µs at 64 rows against the dense path's 67-120 µs, and 106-112 µs (qkv, down)
# at 256 rows against 77.
DEQUANT_MIN_ROWS = 128


@dataclass(frozen=True)
class GemvConfig:
    """Launch choices of the M == 1 kernel: packed words (8 columns each) per program, rows per
    tile (spread over the threads; a step is 4 tiles), warps, and how many programs to aim for
    per SM when choosing the K splits."""

    block_p: int
    block_r: int
    num_warps: int
    programs_per_sm: int = 16
    chain: int = 2  # fp16 kernel: steps summed in fp16 before fp32 (see _gemv_f16_kernel)


@dataclass(frozen=True)
class GemmConfig:
    """Launch choices of the M >= 2 kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    programs_per_sm: int = 2
    swap: bool = False  # _gemm_swap_kernel (weight columns on the MMA's 64-row side)


def gemv_config(n: int, k: int) -> GemvConfig:
    """The M == 1 tile for an [K, N] layer.

    One warp per program, 32 packed words (128-byte rows: whole cache lines, every DRAM sector
    fetched is used) of 4 rows a tile: 16-byte loads, 32 columns a thread, 8 such loads in
    flight per thread (this step's 4 tiles and the next). At ~96 registers about 20 warps fit an
    SM; the K splits aim at about 10 programs per SM in whole groups (``gemv_splits``; 2- and
    4-warp programs were slower on an H200).
    """
    return GemvConfig(block_p=16, block_r=8, num_warps=1, programs_per_sm=10, chain=2)


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The M >= 2 tile for ``m`` rows of an [K, N] layer.

    Below ``DEQUANT_MIN_ROWS`` rows the product is bound by reading and unpacking the weights.
    Measured on an H200 (Llama-2-7B projections, group 128, ``benchmarks/bench_w4a16.py`` with
    explicit splits): up to 32 rows the swapped kernel (``_gemm_swap_kernel``: weight columns on
    the warp-group MMA's 64-row side, the rows on its narrow side, no padding of 16 rows to 64)
    beat the 16-row ``mma.sync`` tiles of ``_gemm_kernel`` by 5-25% (o_proj 15.1 -> 13.0 µs,
    down 30.5 -> 22.9 at 16 rows), with 128-column tiles and about 3 programs per SM for the
    narrow layers and 64-column tiles, one program per SM, for the wide ones at 32 rows. At 64
    rows the swapped kernel won only for gate_up (71 -> 66 µs, 64-column tiles) and down (40 ->
    37, 128 x 64 tiles, split K); qkv and o_proj keep ``_gemm_kernel``'s 64 x 64 tiles.
    """
    if m <= 16:
        return GemmConfig(16, 128, 128, num_warps=4, num_stages=3, programs_per_sm=3, swap=True)
    if m <= 32:
        if n >= 8192:
            return GemmConfig(32, 64, 128, num_warps=4, num_stages=4, programs_per_sm=1, swap=True)
        return GemmConfig(32, 128, 128, num_warps=4, num_stages=3, programs_per_sm=3, swap=True)
    if n >= 16384:
        return GemmConfig(64, 64, 128, num_warps=4, num_stages=4, programs_per_sm=1, swap=True)
    if k >= 8192:
        return GemmConfig(64, 128, 64, num_warps=4, num_stages=3, programs_per_sm=3, swap=True)
    return GemmConfig(64, 64, 128, num_warps=4, num_stages=4, programs_per_sm=1)


def gemv_splits(tiles: int, k: int, group_size: int, step: int, programs: int) -> int | None:
    """K splits of the M == 1 kernel: whole groups per split (a split that cuts a group reloads
    its zeros and scales), as many as bring the programs nearest to ``programs``. ``None`` (let
    ``split_k`` count rows) when there is one group or a step does not divide it.

    On an H200 the best measured split of each Llama-2-7B projection was whole groups at ~8-12
    programs per SM: qkv 2 groups (16 splits, 14.1 µs), o_proj 1 (32, 9.0), gate_up 4 (8, 22.4),
    down 2 (43, 14.9); the previous row-count rule (12 programs per SM in 32-row steps) cut
    groups and took 14.4, 10.2, 28.1 and 15.3 µs."""
    if group_size >= k or group_size % step:
        return None
    groups = cdiv(k, group_size)
    per_split = max(1, round(groups * tiles / programs))
    return cdiv(groups, per_split)


def tile_k(block_k: int, group_size: int, k: int) -> int:
    """The K tile: at most ``block_k`` (and not far past K), a divisor of ``group_size`` when there
    are several groups, and at least 16 (tl.dot's minimum)."""
    bk = max(16, min(block_k, next_pow2(k)))
    if group_size < k:
        while group_size % bk:
            bk //= 2
    return bk


def split_k(
    tiles: int, k: int, unit: int, programs: int, splits: int | None = None, min_units: int = 1,
) -> tuple[int, int]:
    """``(splits, rows per split)`` for ``tiles`` output tiles: about ``programs`` programs in all
    (or ``splits`` when given), each split a whole number of ``unit`` rows (by default at least
    ``min_units`` of them)."""
    units = cdiv(k, unit)
    if splits is None:
        splits = min(cdiv(programs, tiles), units // min_units)
    k_split = cdiv(units, max(1, min(splits, units))) * unit
    return cdiv(k, k_split), k_split
