"""W4A16 (AWQ) kernels: the packing against AutoAWQ's order, the reference, Triton against it.

Case kinds as in ``test_kernels.py``: **interpreter** cases (CPU tensors, small sizes) run here
when this process imports triton in interpreter mode (a machine without CUDA, nothing imported
triton before), otherwise ``test_interpreter_cases_in_child`` runs them in a child pytest with
``TRITON_INTERPRET=1``; **gpu** cases (marked ``gpu``) run compiled at model sizes.

Inputs are fresh random draws (``torch.randn`` activations, random 4-bit weights and zero
points, positive scales) from a per-case seed; outputs are checked as ``||out - ref|| / ||ref||``
against the fp32 reference, with every buffer a launcher allocates filled with NaN first.

Tolerances. The reference dequantizes exactly in fp32 ((q - z) has 5 bits and s 11, so the
product is exact) and multiplies in fp32; only the rounding of the output to x's dtype is
shared (fp16 ~2e-4 rms relative, bf16 ~1.5e-3). The bf16 M == 1 kernel works exactly up to fp32
sums; the fp16 one sums x * (q - z) in fp16 chains of 8 rows before fp32, measured ~5e-4 rms
on these randn inputs (~4.5e-4 in a numpy model of it); limits fp16 1e-3, bf16 1e-2 (the
interpreter converts to bf16 by truncating, a bias of half an ulp: ~4e-3 measured). The fused
M >= 2 kernel (fp16: (q - z) * s rounded to fp16 for the tensor cores) and the dense-weight
path of many rows round each weight to x's dtype: at most 2**-11 (fp16) / 2**-8 (bf16) relative
per weight, independent across the K terms, so about that much rms in the output (~3e-4 /
~2.5e-3) on top; limits fp16 2e-3, bf16 1.5e-2.
"""

import importlib

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.w4a16 import (
    AWQ_NIBBLE_OF_COLUMN,
    AWQ_PACK_ORDER,
    GemmConfig,
    GemvConfig,
    awq_pack,
    awq_unpack,
    dequantize_awq_ref,
    dequantize_awq_triton,
    w4a16_matmul,
    w4a16_matmul_ref,
    w4a16_matmul_triton,
)

# The module whose dispatcher looks up the launcher and the reference.
w4a16_mod = importlib.import_module("conveyor.kernels.w4a16.launch")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
GEMV_TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}  # see the module doc


# --------------------------------------------------------------------------------------------- helpers


def awq_layer(k: int, n: int, group_size: int, seed: int, device: str = "cpu", bias: bool = False):
    """Random (qweight, qzeros, scales, bias, intweight, intzeros) of a [K, N] AWQ layer."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    intweight = torch.randint(0, 16, (k, n), generator=gen)
    intzeros = torch.randint(0, 16, (groups, n), generator=gen)
    # AWQ's scales are (max - min) / 15 of a group: positive, about 1e-3..1e-2 for LLM weights.
    scales = (torch.rand(groups, n, generator=gen) * 0.01 + 0.001).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    to = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    return (to(awq_pack(intweight)), to(awq_pack(intzeros)), to(scales), None if b is None else to(b),
            intweight, intzeros)


def randn(*shape: int, seed: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)


def autoawq_pack_loop(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's packing as its ``WQLinear_GEMM.from_linear`` documents it, loop for loop: for each
    packed column ``col`` and nibble ``i``, ``intweight[:, col * 8 + order_map[i]] << (4 * i)``
    with ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]`` (written here independently of the module)."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, n = intweight.shape
    packed = torch.zeros(rows, n // 8, dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + order_map[i]].to(torch.int64) << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# ------------------------------------------------------------------------------------------ packing


def test_pack_order_hand_built() -> None:
    """Packed words written out by hand from AutoAWQ's order (nibble i holds column ORDER[i])."""
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert AWQ_NIBBLE_OF_COLUMN == (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's AWQ_REVERSE_ORDER
    w = torch.zeros(6, 16, dtype=torch.int64)
    w[0, :8] = torch.arange(8)  # nibbles (low first) 0 2 4 6 1 3 5 7
    w[1, :8] = torch.arange(8, 16)  # nibbles 8 A C E 9 B D F: the sign bit set
    w[2, 1] = 15  # column 1 -> nibble 4
    w[3, 7] = 1  # column 7 -> nibble 7
    w[4, 9] = 3  # column 1 of the second word
    w[5, 2] = 5  # column 2 -> nibble 1
    expected = torch.tensor([
        [0x75316420, 0],
        [0xFDB9ECA8 - 2**32, 0],
        [0x000F0000, 0],
        [0x10000000, 0],
        [0, 0x00030000],
        [0x00000050, 0],
    ], dtype=torch.int32)
    assert torch.equal(awq_pack(w), expected)
    assert torch.equal(awq_unpack(expected).long(), w)


def test_pack_matches_autoawq_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 16, (13, 56), generator=gen)
    assert torch.equal(awq_pack(w), autoawq_pack_loop(w))


def test_unpack_matches_autoawq_unpack_then_reverse(seed: int) -> None:
    """AutoAWQ's ``unpack_awq`` (shifts 0, 4, ..., 28) then ``reverse_awq_order`` (gather
    ``[0, 4, 1, 5, 2, 6, 3, 7]`` within each 8) on any int32, sign bit included."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31, (7, 5), generator=gen, dtype=torch.int64).to(torch.int32)
    nibbles = (packed[:, :, None] >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    order = torch.arange(40).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    assert torch.equal(awq_unpack(packed).long(), nibbles.reshape(7, 40)[:, order].long())


def test_pack_unpack_round_trip(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 16, (33, 4104), generator=gen, dtype=torch.int32)
    packed = awq_pack(w)
    assert packed.dtype == torch.int32 and packed.shape == (33, 513)
    assert torch.equal(awq_unpack(packed).to(torch.int32), w)
    assert torch.equal(awq_pack(awq_unpack(packed)), packed)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        awq_pack(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match="0..15"):
        awq_pack(torch.full((2, 8), 16))
    with pytest.raises(ValueError, match="0..15"):
        awq_pack(torch.full((2, 8), -1))


# ---------------------------------------------------------------------------------------- reference


def test_dequantize_ref_elementwise(seed: int) -> None:
    """Every element against the definition, read bit by bit from the packed words (ragged last group)."""
    k, n, gs = 100, 24, 32  # groups of 32, 32, 32, 4 rows
    qw, qz, s, _, iw, iz = awq_layer(k, n, gs, seed)
    w = dequantize_awq_ref(qw, qz, s, gs)
    assert w.shape == (k, n) and w.dtype == torch.float32
    for kk in range(k):
        for nn in range(0, n, 5):
            shift = 4 * AWQ_NIBBLE_OF_COLUMN[nn % 8]
            q = (int(qw[kk, nn // 8]) >> shift) & 0xF
            z = (int(qz[kk // gs, nn // 8]) >> shift) & 0xF
            assert (q, z) == (int(iw[kk, nn]), int(iz[kk // gs, nn]))
            assert float(w[kk, nn]) == (q - z) * float(s[kk // gs, nn])
    assert dequantize_awq_ref(qw, qz, s, gs, dtype=torch.float16).dtype == torch.float16


def test_ref_is_dequantize_then_matmul(seed: int) -> None:
    k, n, gs = 200, 56, 64
    qw, qz, s, b, _, _ = awq_layer(k, n, gs, seed, bias=True)
    x = randn(2, 3, k, seed=seed, dtype=torch.float32)
    w = dequantize_awq_ref(qw, qz, s, gs)
    torch.testing.assert_close(w4a16_matmul_ref(x, qw, qz, s, gs, b), x @ w + b.float(), rtol=1e-5, atol=1e-5)
    out16 = w4a16_matmul_ref(x.half(), qw, qz, s, gs)
    assert out16.dtype == torch.float16 and out16.shape == (2, 3, n)


def test_group_size_minus_one_is_one_group(seed: int) -> None:
    qw, qz, s, _, _, _ = awq_layer(96, 16, 96, seed)
    torch.testing.assert_close(dequantize_awq_ref(qw, qz, s, -1), dequantize_awq_ref(qw, qz, s, 96))


def test_bad_shapes_raise(seed: int) -> None:
    qw, qz, s, _, _, _ = awq_layer(64, 16, 32, seed)
    x = torch.randn(2, 64).half()
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16_matmul(x, qw, qz, torch.ones(2, 12).half(), 32)
    with pytest.raises(ValueError, match="qzeros"):
        w4a16_matmul(x, qw, qz[:1], s, 32)
    with pytest.raises(ValueError, match="scales"):
        w4a16_matmul(x, qw, qz, s[:1], 32)
    with pytest.raises(ValueError, match="qzeros"):
        w4a16_matmul(x, qw, qz, s, 64)  # one group of 64 rows, not two of 32
    with pytest.raises(ValueError, match="qweight"):
        w4a16_matmul(torch.randn(2, 65).half(), qw, qz, s, 32)


# ------------------------------------------------------------------------------- interpreter: Triton

# (M, K, N, group_size): K = 576 with groups of 128 ends in a 64-row group; K = 200 is a multiple
# of no K tile (and of no group but 8 rows); N = 8 is one packed word, 56 not a power of two,
# 4104 = 4096 + 8 one word past a tile.
GEMV_CASES = [(1, 576, 56, 128), (1, 200, 8, 64), (1, 200, 56, 32), (1, 96, 4104, 32)]
GEMM_CASES = [(3, 576, 56, 128), (17, 200, 8, 64), (17, 200, 56, 32), (64, 96, 136, 32), (3, 64, 4104, 64)]


def _ids(cases: list[tuple[int, ...]]) -> list[str]:
    return [f"m{m}_k{k}_n{n}_g{g}" for m, k, n, g in cases]


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES + GEMM_CASES, ids=_ids(GEMV_CASES + GEMM_CASES))
def test_triton_matches_ref(case: tuple[int, ...], dtype: torch.dtype, seed: int, forced: None) -> None:
    """The dispatcher (forced to Triton) with the default tiles and split choice."""
    m, k, n, gs = case
    qw, qz, s, b, _, _ = awq_layer(k, n, gs, seed, bias=m % 2 == 1)
    x = randn(m, k, seed=seed, dtype=dtype)
    tol = (GEMV_TOL if m == 1 else TOL)[dtype]
    assert_close(w4a16_matmul(x, qw, qz, s, gs, b), w4a16_matmul_ref(x, qw, qz, s, gs, b), tol)


@interp
@pytest.mark.parametrize("gs", [32, -1], ids=["g32", "one_group"])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_gemv_splits(splits: int, gs: int, seed: int, poisoned_empty: None) -> None:
    """No split; 3 splits (groups cut between programs, the last split short); more splits asked
    than 16-row steps allow (one or two steps each). Small tiles: 8 words, 4 rows a tile."""
    m, k, n = 1, 200, 56
    qw, qz, s, b, _, _ = awq_layer(k, n, k if gs == -1 else gs, seed, bias=True)
    x = randn(m, k, seed=seed, dtype=torch.float16)
    out = w4a16_matmul_triton(x, qw, qz, s, gs, b, gemv=GemvConfig(8, 4, 1), splits=splits)
    assert_close(out, w4a16_matmul_ref(x, qw, qz, s, gs, b), GEMV_TOL[torch.float16])


@interp
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_gemm_tiles_and_splits(splits: int, seed: int, poisoned_empty: None) -> None:
    """Several M and N tiles in bands of 2 (the L2 ordering), a partial last band, split K."""
    m, k, n, gs = 40, 160, 264, 32
    qw, qz, s, b, _, _ = awq_layer(k, n, gs, seed, bias=splits == 2)
    x = randn(m, k + 5, seed=seed, dtype=torch.float16)[:, :k]  # rows with a stride wider than K
    out = w4a16_matmul_triton(x, qw, qz, s, gs, b, gemm=GemmConfig(16, 128, 32, 4, 1, group_m=2), splits=splits)
    assert_close(out, w4a16_matmul_ref(x, qw, qz, s, gs, b), TOL[torch.float16])


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("m", "splits"), [(1, 1), (3, 2), (40, 1), (40, 3)])
def test_gemm_swapped_operands(m: int, splits: int, dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """The swapped kernel (out^T = W^T x^T): one row, several M tiles, a partial N tile (264
    columns in tiles of 64), a last group of 16 rows (K = 176), split K, bias, x rows strided."""
    k, n, gs = 176, 264, 32
    qw, qz, s, b, _, _ = awq_layer(k, n, gs, seed, bias=m % 2 == 1)
    x = randn(m, k + 5, seed=seed, dtype=dtype)[:, :k]
    cfg = GemmConfig(16, 64, 32, 4, 1, swap=True)
    out = w4a16_matmul_triton(x, qw, qz, s, gs, b, gemm=cfg, splits=splits)
    assert_close(out, w4a16_matmul_ref(x, qw, qz, s, gs, b), TOL[dtype])


@interp
@pytest.mark.parametrize("gs", [32, -1], ids=["g32", "one_group"])
def test_dequant_path(gs: int, seed: int, poisoned_empty: None) -> None:
    """The dense-weight path of many rows: the Triton dequantization rounds (q - z) * s once, as
    the reference's fp32 value converted; then a plain matmul (bias added by addmm)."""
    k, n = 200, 56
    qw, qz, s, b, _, _ = awq_layer(k, n, k if gs == -1 else gs, seed, bias=True)
    w = dequantize_awq_triton(qw, qz, s, gs, torch.float16)
    assert torch.equal(w, dequantize_awq_ref(qw, qz, s, gs, dtype=torch.float16))
    x = randn(2, 5, k, seed=seed, dtype=torch.float16)
    out = w4a16_matmul_triton(x, qw, qz, s, gs, b, dequant=True)
    assert_close(out, w4a16_matmul_ref(x, qw, qz, s, gs, b), TOL[torch.float16])


@interp
def test_leading_dims_and_one_group(seed: int, forced: None) -> None:
    """x [..., K] keeps its leading dims; group_size -1 (one group) and one larger than K."""
    k, n = 80, 24
    qw, qz, s, _, _, _ = awq_layer(k, n, k, seed)
    for shape in ((2, 3, k), (1, 1, k), (k,)):
        x = randn(*shape, seed=seed, dtype=torch.float16)
        ref = w4a16_matmul_ref(x, qw, qz, s, k)
        tol = (GEMV_TOL if x.numel() == k else TOL)[torch.float16]
        assert_close(w4a16_matmul(x, qw, qz, s, -1), ref, tol)
        assert_close(w4a16_matmul(x, qw, qz, s, 128), ref, tol)
    empty = w4a16_matmul(torch.zeros(0, k).half(), qw, qz, s, -1)
    assert empty.shape == (0, n)


@interp
def test_forced_triton_rejects_unsupported(seed: int, forced: None) -> None:
    qw, qz, s, _, _, _ = awq_layer(64, 16, 8, seed)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(torch.randn(2, 64).half(), qw, qz, s, 8)
    qw, qz, s, _, _, _ = awq_layer(64, 16, 32, seed)
    with pytest.raises(ValueError, match="dtype"):
        w4a16_matmul(torch.randn(2, 64), qw, qz, s, 32)


# -------------------------------------------------------------------------------- dispatch (any mode)


def test_auto_and_ref_modes_use_the_reference_on_cpu(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("Triton launcher called")

    monkeypatch.setattr(w4a16_mod, "w4a16_matmul_triton", boom)
    qw, qz, s, _, _, _ = awq_layer(64, 16, 32, seed)
    for mode in ("auto", "ref"):
        set_kernel_mode(mode)
        for m in (1, 5):
            x = torch.randn(m, 64).half()
            assert torch.equal(w4a16_matmul(x, qw, qz, s, 32), w4a16_matmul_ref(x, qw, qz, s, 32))


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cases run in this process")
def test_interpreter_cases_in_child() -> None:
    """Run this file's interpreter cases in a child process that imports triton interpreted."""
    run_interpreter_cases_in_child(__file__)


# -------------------------------------------------------------------------------------------------- GPU

GPU_DTYPES = [torch.float16, torch.bfloat16]
# Llama-2-7B projections (qkv, o, gate_up, down), the odd shapes of the interpreter cases at
# model widths, and a 56-column layer.
GPU_SHAPES = [(4096, 12288, 128), (4096, 4096, 128), (4096, 22016, 128), (11008, 4096, 128),
              (576, 4104, 128), (200, 11008, 64), (4096, 56, 32), (2048, 8, 64)]
GPU_ROWS = [1, 3, 17, 64, 256, 2048]


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"k{k}_n{n}_g{g}" for k, n, g in GPU_SHAPES])
def test_gpu_w4a16(shape: tuple[int, int, int], dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    k, n, gs = shape
    qw, qz, s, b, _, _ = awq_layer(k, n, gs, seed, device="cuda", bias=True)
    w = dequantize_awq_ref(qw, qz, s, gs)
    for m in GPU_ROWS:
        x = randn(m, k, seed=seed + m, dtype=dtype, device="cuda")
        ref = ((x.float() @ w) + b.float()).to(dtype)
        outs = {"dispatch": w4a16_matmul(x, qw, qz, s, gs, b)}
        if m > 1:  # both M >= 2 paths at every M: the fused kernel and the dense-weight one
            outs["fused"] = w4a16_matmul_triton(x, qw, qz, s, gs, b, dequant=False)
            outs["dequant"] = w4a16_matmul_triton(x, qw, qz, s, gs, b, dequant=True)
        for path, out in outs.items():
            try:
                assert_close(out, ref, (GEMV_TOL if m == 1 else TOL)[dtype])
            except AssertionError as exc:
                raise AssertionError(f"M = {m}, {path}: {exc}") from None


@gpu
@compiled_gpu
def test_gpu_dispatch_picks_triton(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("reference called on CUDA tensors")

    monkeypatch.setattr(w4a16_mod, "w4a16_matmul_ref", boom)
    qw, qz, s, _, _, _ = awq_layer(256, 64, 128, seed, device="cuda")
    for m in (1, 4):
        w4a16_matmul(torch.randn(m, 256, device="cuda", dtype=torch.float16), qw, qz, s, 128)
    torch.cuda.synchronize()
