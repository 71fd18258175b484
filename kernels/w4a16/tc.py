"""W4A16 on tensor cores: the CUDA kernels of ``tc_gemm.cu`` (compiled at run time, ``_cuda.py``),
their weight layout, launch policy and launchers. fp16 activations; sm_80 or later.

Triton cannot place dequantized nibbles in an MMA's register layout, so the Triton GEMV reads the
weights at ~40-50 % of HBM bandwidth (``launch.py``). Here the weight is repacked once, at load,
into the order in which ``mma.m16n8k16`` wants its A operand, and each lane's 32-bit word is
turned into its fragment in registers by 4 LOP3s and 8 half2 operations.

The product runs transposed, ``out^T = W^T x^T``: 16 weight columns fill the MMA's 16-row side
and 8 rows of x its 8-wide side (a decode step of one row pads to 8, not to 16).

Layout (``tc_repack``): ``qw`` int32 [K / 64, N / 16, 32, 4]. For a 64-row stage ``s``, a 16-column
tile ``t`` and a lane ``l = 4 g + c``, word ``i`` covers rows ``64 s + 16 i .. + 16``; with
``k0 = 64 s + 16 i + 2 c`` and ``n0 = 16 t + g`` its nibbles hold

    nibble 0: (k0, n0)      nibble 4: (k0 + 1, n0)        -> the fragment's a0, a1
    nibble 1: (k0, n0 + 8)  nibble 5: (k0 + 1, n0 + 8)    -> a2, a3
    nibble 2: (k0 + 8, n0)  nibble 6: (k0 + 9, n0)        -> a4, a5
    nibble 3: (k0 + 8, n0 + 8)  nibble 7: (k0 + 9, n0 + 8)  -> a6, a7

(PTX ISA, "Matrix fragments for mma.m16n8k16" with .f16: a0..a7 at rows ``g``, ``g + 8`` and
columns ``2c``, ``2c + 1``, ``2c + 8``, ``2c + 9``). ``zeros`` are unpacked to uint8 [G, N] and
``scales`` stay [G, N]; a stage's 64 rows lie in one group (``group_size % 64 == 0``).

A CTA computes ``N_TILE = warps * nw * 16`` columns for ``8 * m8`` rows over a range of stages,
streamed through shared memory ``stages`` deep by ``cp.async``; K is split so that the CTAs fill
the GPU, and the last CTA of a tile to finish adds the splits' fp32 partials in order.

On Hopper (sm_90a), ``WG_MIN_ROWS`` to ``TC_DEQUANT_MIN_ROWS - 1`` rows take the warp-group kernel
(``w4a16_wg_gemm``): the same words are wgmma's register A operand as they stand, and x enters
through a swizzled shared-memory descriptor, so a CTA of 4 warps multiplies 64 columns by 32-128
rows without ``mma.sync``'s per-fragment loads of x.

From ``TC_DEQUANT_MIN_ROWS`` rows on, ``tc_dequantize`` writes the dense fp16 weight and cuBLAS
multiplies (prefill is compute-bound; cuBLAS's warp-group MMAs beat ``mma.sync`` there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .._cuda import compiles, cuda_kernels_available, device_index, kernel, launch
from .._triton import cdiv, sm_count
from .launch import split_counters
from .packing import awq_unpack, check_awq_shapes

SOURCE = Path(__file__).with_name("tc_gemm.cu")
STAGE_K = 64  # = STAGE_K in tc_gemm.cu
TC_DEQUANT_MIN_ROWS = 128
REPACK_ROWS = 256  # rows repacked at a time (a multiple of STAGE_K)


@dataclass(frozen=True)
class TcConfig:
    """A compiled instance of ``w4a16_tc_gemm``: 8-row groups of x per CTA, 16-column tiles per
    warp, warps per CTA (``wm`` of them along the rows), pipeline depth in 64-row stages."""

    m8: int
    nw: int
    warps: int
    stages: int
    wm: int = 1
    scale_sums: bool = True  # scale each group's fp32 sums (else the fp16 fragments)
    ctas_per_sm: int = 0  # CTAs per SM the K splits aim at (0: 16 for one-warp CTAs, 2 from 32 rows, else 4)

    @property
    def target_per_sm(self) -> int:
        return self.ctas_per_sm or (16 if self.warps == 1 else 2 if self.m8 >= 4 else 4)

    @property
    def n_tile(self) -> int:
        return self.warps // self.wm * self.nw * 16

    @property
    def name(self) -> str:
        return (f"w4a16_tc_gemm<{self.m8}, {self.nw}, {self.warps}, {self.wm}, {self.stages}, "
                f"{'true' if self.scale_sums else 'false'}>")

    def shared_bytes(self) -> int:
        """Dynamic shared memory: ``stages`` x (weights + x rows + scales + zeros), as the kernel lays it."""
        rows = 8 * self.m8
        return self.stages * (self.n_tile * 32 + rows * (STAGE_K + 8) * 2 + self.n_tile * 3)


# Every instance the module is compiled with (one NVRTC compilation for all of them).
CONFIGS = (*(TcConfig(m8, nw, 4, 4) for m8 in (1, 2, 4) for nw in (1, 2, 4)),
           TcConfig(1, 4, 4, 3), TcConfig(8, 1, 4, 4), TcConfig(1, 2, 1, 4), TcConfig(1, 4, 1, 6),
           TcConfig(4, 2, 4, 4, scale_sums=False), TcConfig(8, 1, 4, 4, scale_sums=False),
           # warps along the rows too: 32-128 rows
           TcConfig(4, 2, 4, 4, wm=2), TcConfig(4, 4, 4, 4, wm=2), TcConfig(8, 2, 4, 4, wm=2),
           TcConfig(8, 4, 4, 4, wm=2, scale_sums=False), TcConfig(8, 2, 8, 4, wm=2, scale_sums=False),
           TcConfig(8, 2, 8, 4, wm=4), TcConfig(16, 2, 8, 4, wm=4, scale_sums=False),
           TcConfig(16, 2, 8, 4, wm=2, scale_sums=False))
DEQUANT_NAME = "w4a16_tc_dequant"
_NAMES = tuple(c.name for c in CONFIGS) + (DEQUANT_NAME,)


@dataclass
class TcWeights:
    """One layer's weight in the tensor-core layout (see the module doc)."""

    qw: torch.Tensor  # int32 [K / 64, N / 16, 32, 4]
    scales: torch.Tensor  # fp16 [G, N]
    zeros: torch.Tensor  # uint8 [G, N]
    group_size: int
    k: int
    n: int


def tc_builds(device: torch.device) -> bool:
    """Whether the kernels compile on ``device`` (checked once; see ``_cuda.compiles``)."""
    return compiles(SOURCE, _NAMES, device_index(device))


def tc_problem(k: int, n: int, group_size: int, dtype: torch.dtype) -> str | None:
    """Why the tensor-core kernels cannot take a [K, N] layer of ``group_size`` (resolved: K for
    one group) in ``dtype``, or None when they can."""
    if dtype != torch.float16:
        return f"dtype {dtype} (fp16 only)"
    if k % STAGE_K or n % 64:
        return f"K = {k} or N = {n} is not a multiple of 64"
    if group_size % STAGE_K:
        return f"group_size {group_size} is not a multiple of 64"
    return None


def _permuted_codes(codes: torch.Tensor) -> torch.Tensor:
    """The codes [K, N] as [K/64, N/16, 8 (g), 4 (c), 4 (word), 8 (nibble)] (see the module doc):
    k = 64 s + 16 word + 8 khalf + 2 c + kpair, n = 16 t + 8 nhalf + g, nibble = 4 kpair + 2 khalf + nhalf."""
    k, n = codes.shape
    v = codes.reshape(k // 64, 4, 2, 4, 2, n // 16, 2, 8)  # s, word, khalf, c, kpair, t, nhalf, g
    return v.permute(0, 5, 7, 3, 1, 4, 2, 6).reshape(k // 64, n // 16, 8, 4, 4, 8)


def tc_pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [K, N] (natural order, values 0..15) -> ``qw`` int32 [K / 64, N / 16, 32, 4]."""
    k, n = codes.shape
    nib = _permuted_codes(codes.to(torch.int64))
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (nib << shifts).sum(-1)  # 0 .. 2**32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(k // 64, n // 16, 32, 4).contiguous()


def tc_unpack_codes(qw: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tc_pack_codes`: ``qw`` -> codes [K, N] uint8."""
    s, t = qw.shape[:2]
    shifts = torch.arange(0, 32, 4, device=qw.device, dtype=torch.int32)
    nib = (qw.reshape(s, t, 8, 4, 4, 1) >> shifts) & 0xF  # s, t, g, c, word, nibble
    v = nib.reshape(s, t, 8, 4, 4, 2, 2, 2)  # s, t, g, c, word, kpair, khalf, nhalf
    return v.permute(0, 4, 6, 3, 5, 1, 7, 2).reshape(s * 64, t * 16).to(torch.uint8)


def tc_repack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> TcWeights:
    """An AWQ triple (``packing.py``'s layout) in the tensor-core layout; raises ValueError for a
    layer the kernels cannot take (``tc_problem``)."""
    k = qweight.shape[0]
    n, group_size = check_awq_shapes(k, qweight, qzeros, scales, group_size)
    problem = tc_problem(k, n, group_size, scales.dtype)
    if problem:
        raise ValueError(f"the tensor-core W4A16 kernels cannot take this layer: {problem}")
    qw = torch.empty(k // STAGE_K, n // 16, 32, 4, dtype=torch.int32, device=qweight.device)
    step = REPACK_ROWS
    for r in range(0, k, step):  # in row blocks: the int64 temporaries are 16 bytes a weight
        qw[r // STAGE_K: (r + step) // STAGE_K] = tc_pack_codes(awq_unpack(qweight[r: r + step]))
    return TcWeights(qw, scales.contiguous(), awq_unpack(qzeros).contiguous(), group_size, k, n)


def tc_dequantize_ref(w: TcWeights) -> torch.Tensor:
    """Plain torch: the dense weight [K, N] in fp32 from the tensor-core layout."""
    codes = tc_unpack_codes(w.qw).float()
    rows = torch.arange(w.k, device=w.qw.device) // w.group_size
    return (codes - w.zeros.float()[rows]) * w.scales.float()[rows]


@functools.cache  # called at every launch; m (< TC_DEQUANT_MIN_ROWS) and the layer shapes are few
def tc_config(m: int, n: int, k: int) -> TcConfig:
    """The instance for ``m`` rows of an [K, N] layer, from sweeps of ``bench_w4a16_tc`` on an
    H200 (Llama-2-7B projections, ``docs/benchmarks.md``): one row takes 4 tiles a warp on wide
    layers (qkv, gate_up) and 2 on narrow ones; 2-8 rows 2 tiles; 9-16 rows two 8-row groups and
    one tile (two on gate_up); 17-64 rows four groups and 2 tiles (one on narrow layers), wide
    layers unsplit; 65 rows on eight groups and one tile (gate_up: 4 tiles, 2 warps along the
    rows, scales on the fragments). An instance whose tile does not divide N (a multiple of 64)
    gives way to fewer tiles a warp, then to the compiled one-tile instance of as many rows."""
    wide = n >= 8192
    if m == 1:
        cfg = TcConfig(1, 4 if wide else 2, 4, 4)
    elif m <= 8:
        cfg = TcConfig(1, 2, 4, 4)
    elif m <= 16:
        cfg = TcConfig(2, 2 if n >= 16384 else 1, 4, 4)
    elif m <= 64:
        cfg = TcConfig(4, 2 if wide else 1, 4, 4, ctas_per_sm=1 if wide else 4)
    elif n >= 16384:
        cfg = TcConfig(8, 4, 4, 4, wm=2, scale_sums=False, ctas_per_sm=1)
    else:
        cfg = TcConfig(8, 1, 4, 4, ctas_per_sm=1 if k < 8192 else 4)
    while n % cfg.n_tile or cfg.name not in _NAMES:  # ends at (m8, 1, 4, 4): compiled, 64 columns
        cfg = replace(cfg, nw=cfg.nw // 2) if cfg.nw > 1 else replace(cfg, warps=4, wm=1, scale_sums=True)
    return cfg


def tc_stages_per_split(tiles: int, k: int, sms: int, ctas_per_sm: int, splits: int | None = None) -> int:
    """64-row stages per K split: as many splits as bring ``tiles`` output tiles nearest to
    ``ctas_per_sm`` CTAs per SM (or ``splits`` when given), each at least 2 stages."""
    stages = k // STAGE_K
    if splits is None:
        splits = max(1, min(stages // 2, round(sms * ctas_per_sm / tiles)))
    return cdiv(stages, max(1, min(splits, stages)))


def _rows(x: torch.Tensor, w: TcWeights, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [..., K]`` as the kernels read it (fp16 rows of 16-byte aligned, unit-stride K) and an
    fp16 bias; a ValueError when x is not fp16 or its K is not the layer's."""
    if x.dtype != torch.float16 or x.shape[-1] != w.k:
        raise ValueError(f"x must be fp16 [..., {w.k}], got {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    return x2, bias.half() if bias is not None and bias.dtype != torch.float16 else bias


def tc_matmul(x: torch.Tensor, w: TcWeights, bias: torch.Tensor | None = None, *, cfg: TcConfig | None = None,
              splits: int | None = None, dequant: bool | None = None, pdl: bool = True) -> torch.Tensor:
    """``x [..., K] @ W + bias`` -> [..., N] fp16, W in the tensor-core layout. The keywords are
    for tuning and tests: the ``mma.sync`` instance and the K splits (either keeps that kernel
    where the policy would take the warp-group one), whether to take the dense-weight path, and
    whether to launch the mma.sync kernel with programmatic dependent launch (the weights of its
    first stages are then requested while the kernel before still runs; ``_cuda.launch``)."""
    x2, bias = _rows(x, w, bias)
    m = x2.shape[0]
    if dequant if dequant is not None else m >= TC_DEQUANT_MIN_ROWS:
        dense = tc_dequantize(w)
        out = torch.matmul(x2, dense) if bias is None else torch.addmm(bias.to(x.dtype), x2, dense)
        return out.view(*x.shape[:-1], w.n)
    if cfg is None and splits is None and wg_takes(m, x.device):
        return wg_matmul(x2, w, bias).view(*x.shape[:-1], w.n)
    out = torch.empty(m, w.n, dtype=torch.float16, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], w.n)
    cfg = cfg or tc_config(m, w.n, w.k)
    if w.n % cfg.n_tile:
        raise ValueError(f"N = {w.n} is not a multiple of the {cfg.n_tile}-column tile of {cfg.name}")
    tiles = (w.n // cfg.n_tile, cdiv(m, 8 * cfg.m8))
    per_split = tc_stages_per_split(tiles[0] * tiles[1], w.k, sm_count(x.device), cfg.target_per_sm, splits)
    _launch_tiles(cfg.name, _NAMES, (), x2, w, bias, out, tiles, per_split, 32 * cfg.warps, cfg.shared_bytes(),
                  pdl=pdl)
    return out.view(*x.shape[:-1], w.n)


def _launch_tiles(name: str, names: tuple[str, ...], options: tuple[str, ...], x2: torch.Tensor, w: TcWeights,
                  bias: torch.Tensor | None, out: torch.Tensor, tiles: tuple[int, int], per_split: int,
                  threads: int, shared: int, pdl: bool = False) -> None:
    """Launch kernel ``name`` (either kernel of ``tc_gemm.cu``: they take the same arguments) over
    ``tiles`` (column tiles, row tiles) and the K splits of ``per_split`` stages each, with the
    fp32 partials and split counters the splits need."""
    n_splits = cdiv(w.k // STAGE_K, per_split)
    m = x2.shape[0]
    part = torch.empty(n_splits, m, w.n, dtype=torch.float32, device=x2.device) if n_splits > 1 else None
    counters = split_counters(x2.device, tiles[0] * tiles[1])
    fn = kernel(SOURCE, name, names, device_index(x2.device), shared, options)
    launch(fn, x2.device, (tiles[0], n_splits, tiles[1]), (threads,),
           (x2, m, x2.stride(0), w.qw, w.scales, w.zeros, bias, out, out.stride(0), part, counters,
            w.n, w.k, w.group_size // STAGE_K, per_split), shared, pdl=pdl)


@dataclass(frozen=True)
class WgConfig:
    """A compiled instance of ``w4a16_wg_gemm`` (warp-group MMAs, sm_90a): rows of x a CTA (the
    wgmma's N), pipeline depth in 64-row stages. A CTA is one warp group and 64 columns."""

    rows: int
    stages: int  # even: two fragment buffers alternate

    @property
    def name(self) -> str:
        return f"w4a16_wg_gemm<{self.rows}, {self.stages}>"

    def shared_bytes(self) -> int:
        """``stages`` x the stage (``wg_stage_bytes`` in tc_gemm.cu), plus 1024 bytes to align the ring."""
        stage = -(-(self.rows * 128 + 4 * 32 * 16 + WG_COLS * 3) // 1024) * 1024
        return self.stages * stage + 1024


WG_COLS = 64  # = WG_COLS in tc_gemm.cu
WG_MIN_ROWS = 16  # fewer rows: mma.sync's 8-row side pads less than wgmma's 32
WG_CONFIGS = tuple(WgConfig(r, s) for r, s in ((32, 6), (32, 8), (64, 4), (64, 6), (128, 4), (128, 6)))
_WG_NAMES = tuple(c.name for c in WG_CONFIGS)
# The warp-group MMAs are an arch-specific feature of sm_90: the module is built for sm_90a.
WG_OPTIONS = ("--gpu-architecture=sm_90a", "-DW4A16_REQUIRE_WGMMA")


@functools.cache  # asked at every launch of 16-127 rows
def wg_builds(device: torch.device) -> bool:
    """Whether the warp-group kernels run on ``device``: an sm_90 GPU whose NVRTC builds sm_90a."""
    return (cuda_kernels_available(device) and torch.cuda.get_device_capability(device_index(device)) == (9, 0)
            and compiles(SOURCE, _WG_NAMES, device_index(device), WG_OPTIONS))


def wg_takes(m: int, device: torch.device) -> bool:
    """Whether ``tc_matmul``'s policy runs ``m`` rows on the warp-group kernel."""
    return WG_MIN_ROWS <= m < TC_DEQUANT_MIN_ROWS and wg_builds(device)


def wg_config(m: int) -> WgConfig:
    """The instance for ``m`` rows: the 32-row tile up to 32 rows, else 64-row tiles (past 64 rows
    two of them tie with one 128-row tile over the Llama-2-7B projections in ``bench_w4a16_tc``;
    the 32-row tile 8 deep holds fewer CTAs an SM and lost up to 40 % on gate_up)."""
    return WgConfig(32, 6) if m <= 32 else WgConfig(64, 6)


def wg_splits(tiles: int, k: int, sms: int) -> int:
    """K splits for ``tiles`` output tiles: the largest power of two up to 3 CTAs an SM, each split
    at least 2 stages. In ``bench_w4a16_tc``'s sweep (Llama-2-7B, 16-112 rows) this was the
    fastest count, or within 3 % of it, on every layer: qkv's 192 tiles split in 2, gate_up's 344
    not, 64 tiles in 4 (more splits cost more than the SMs they fill)."""
    splits = 1
    while splits * 2 * tiles <= 3 * sms and splits * 2 <= k // STAGE_K // 2:
        splits *= 2
    return splits


def wg_matmul(x: torch.Tensor, w: TcWeights, bias: torch.Tensor | None = None, *, cfg: WgConfig | None = None,
              splits: int | None = None) -> torch.Tensor:
    """``x [..., K] @ W + bias`` -> [..., N] fp16 by the warp-group kernel (``wg_builds`` must hold);
    the keywords are for tuning and tests."""
    x2, bias = _rows(x, w, bias)
    m = x2.shape[0]
    cfg = cfg or wg_config(m)
    if cfg not in WG_CONFIGS:
        raise ValueError(f"{cfg.name} is not compiled; one of {_WG_NAMES}")
    out = torch.empty(m, w.n, dtype=torch.float16, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], w.n)
    tiles = (w.n // WG_COLS, cdiv(m, cfg.rows))
    sms = sm_count(x.device)
    if splits is None:
        splits = wg_splits(tiles[0] * tiles[1], w.k, sms)
    per_split = tc_stages_per_split(tiles[0] * tiles[1], w.k, sms, 0, splits)
    _launch_tiles(cfg.name, _WG_NAMES, WG_OPTIONS, x2, w, bias, out, tiles, per_split, 128, cfg.shared_bytes())
    return out.view(*x.shape[:-1], w.n)


def tc_dequantize(w: TcWeights) -> torch.Tensor:
    """The dense fp16 weight [K, N] from the tensor-core layout (a CUDA kernel)."""
    out = torch.empty(w.k, w.n, dtype=torch.float16, device=w.qw.device)
    fn = kernel(SOURCE, DEQUANT_NAME, _NAMES, device_index(w.qw.device))
    launch(fn, w.qw.device, (w.n // 64, w.k // STAGE_K), (128,),
           (w.qw, w.scales, w.zeros, out, w.n, w.group_size // STAGE_K))
    return out
