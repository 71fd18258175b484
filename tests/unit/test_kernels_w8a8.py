"""W8A8 kernels (kernels/w8a8.py): references against float math, Triton against the references.

Three kinds of case, as in test_kernels.py:

* **reference** cases (any machine): the quantizer's error bound and rounding, the int32 sums'
  exactness, W8A8 against a float GEMM, per-token scales under outliers;
* **interpreter** cases (CPU tensors, small sizes): Triton's interpreter runs the kernels. Triton
  picks interpreter or compiled mode once per process; where this process has it compiled (a GPU
  machine, or an earlier module imported triton), ``test_interpreter_cases_in_child`` runs them
  in a child pytest with ``TRITON_INTERPRET=1``;
* **gpu** cases (marked ``gpu``, skipped without CUDA): model sizes and the odd shapes, fp16/bf16.

Every buffer a launcher allocates is poisoned first (``poisoned_empty``: floats NaN, int8 -128, a
code the quantizer never writes), so an element a kernel forgets to write fails.
"""

import importlib

import pytest
import torch

# kernel_harness first: where Triton is missing, importing it skips this file.
from kernel_harness import assert_close, compiled_gpu, gpu, interp, rel_err, run_interpreter_cases_in_child
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.rms_norm import add_rms_norm_ref, rms_norm_ref
from conveyor.kernels.activation import silu_and_mul_ref
from conveyor.kernels.w8a8 import (
    silu_mul_quant,
    silu_mul_quant_ref,
    MATMUL_CONFIGS,
    int8_matmul,
    int8_matmul_int_mm,
    int8_matmul_ref,
    int8_matmul_triton,
    int8_mm_int32_ref,
    quant_per_token,
    quant_per_token_ref,
    rms_norm_quant,
    rms_norm_quant_ref,
)

w8a8_mod = importlib.import_module("conveyor.kernels.w8a8")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# int8_matmul: Triton and the reference add the same exact int32 sums and apply the epilogue in
# float32 in the same order; they can differ only by an FMA the compiler forms (one float32 ulp), so
# by at most one rounding of the output in rare elements: within half a ulp of the output dtype in
# norm (fp16 ulp 2**-10, bf16 2**-7 relative). The interpreter's fp32 -> bf16 conversion truncates
# instead of rounding: up to one bf16 ulp in every element (2**-8 on average), hence 1e-2 for bf16.
MATMUL_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
GPU_MATMUL_TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
# W8A8 against the float GEMM: each side's rounding to 255 levels adds uniform noise of std
# amax / (127 * sqrt(12)) per element, ~0.7% of a Gaussian row's rms for K in the hundreds (amax
# ≈ 3.2 sigma), ~1.0% for both sides together; 2.5e-2 is 2.5 times that.
W8A8_TOL = 2.5e-2


# --------------------------------------------------------------------------------------------- helpers


def dequant(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return xq.double() * scale.double()


# One ulp of each dtype, relative: how far two roundings of nearly equal values can land apart.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_codes_close(
    out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], normed_dtype: torch.dtype | None = None
) -> None:
    """Quantizer outputs (xq, scale) against the reference's.

    Without ``normed_dtype`` the same float32 rows went in, so the same codes and scales must come
    out, bit for bit. With it (rms_norm_quant), the normalized rows differ by reduction order (~1e-7
    relative), which flips the rounding to ``normed_dtype`` of the few values that sit that close to
    a rounding midpoint: such a value moves by one ulp of the dtype; if it is a row's maximum, that
    row's scale moves by up to one ulp and every code of the row by up to 127 ulp (0.12 of a step in
    fp16, 1 in bf16). So: scales within one ulp, codes within 1 (bf16: 2), and few codes changed.
    """
    (xq, scale), (ref_q, ref_s) = out[:2], ref[:2]
    assert xq.dtype == torch.int8 and scale.dtype == torch.float32
    assert xq.shape == ref_q.shape and scale.shape == ref_s.shape == (ref_q.shape[0], 1)
    assert int(xq.min()) >= -127, "unwritten codes (or -128)"
    assert torch.isfinite(scale).all(), "unwritten scales"
    if normed_dtype is None:
        assert torch.equal(xq, ref_q), f"{int((xq != ref_q).sum())} codes differ"
        assert torch.equal(scale, ref_s), f"scales differ by up to {float((scale - ref_s).abs().max()):.3g}"
        return
    torch.testing.assert_close(scale, ref_s, rtol=max(ULP[normed_dtype], 1e-5), atol=0)
    diff = (xq.int() - ref_q.int()).abs()
    assert int(diff.max()) <= (2 if normed_dtype == torch.bfloat16 else 1), f"codes differ by up to {int(diff.max())}"
    changed = float((diff > 0).float().mean())
    assert changed <= 1e-2, f"{changed:.2%} of the codes differ"


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def randint8(*shape: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)


def with_special_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows >= 3, K >= 6] with row 0 all zero and row 2 built to hit rounding ties exactly:
    amax 127 makes the multiplier 1, so 0.5, 1.5, 2.5, -2.5 must round half to even."""
    x = x.clone()
    x[0] = 0
    x[2] = 0
    x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5])
    return x


def matmul_case(m: int, n: int, k: int, gen: torch.Generator, bias: bool, device: str = "cpu"):
    """Random int8 operands over their full range, per-row and per-channel scales, optional bias."""
    xq, wq = randint8(m, k, gen=gen, device=device), randint8(n, k, gen=gen, device=device)
    x_scale = (torch.rand(m, 1, generator=gen) * 0.02 + 1e-3).to(device)
    w_scale = (torch.rand(n, generator=gen) * 0.02 + 1e-3).to(device)
    b = randn(n, gen=gen, device=device) if bias else None
    return xq, x_scale, wq, w_scale, b


def outlier_activations(m: int, k: int, gen: torch.Generator, dtype: torch.dtype, device: str = "cpu"):
    """Gaussian rows; rows 1 and m-2 carry four columns 100x larger (LLM activation outliers)."""
    x = randn(m, k, gen=gen)
    rows, cols = [1, m - 2], torch.randperm(k, generator=gen)[:4]
    for r in rows:
        x[r, cols] *= 100.0
    return x.to(device=device, dtype=dtype), rows


def check_outliers(xq: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, outlier_rows: list[int]) -> None:
    """Per-token scales: rows without outliers dequantize as accurately as plain Gaussian rows,
    and far better than with one scale for the whole tensor (which the outliers would set)."""
    plain = [r for r in range(x.shape[0]) if r not in outlier_rows]
    xd = x.double()
    err = (dequant(xq, scale) - xd)[plain].norm(dim=-1) / xd[plain].norm(dim=-1)
    # Uniform rounding noise of amax / (127 sqrt(12)) against a unit rms: ~0.7%; 1.5e-2 bound.
    assert float(err.max()) < 1.5e-2, f"rows without outliers lost accuracy: {float(err.max()):.3g}"
    tensor_scale = xd.abs().max() / 127
    per_tensor = (torch.round(xd / tensor_scale) * tensor_scale - xd)[plain].norm(dim=-1) / xd[plain].norm(dim=-1)
    assert float(per_tensor.min()) > 10 * float(err.max()), "the case does not separate per-token from per-tensor"


# --------------------------------------------------------------------------------- references (any mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quant_ref_error_bound(dtype: torch.dtype, seed: int) -> None:
    """Every element within half a step of its row's scale; the row's max hits ±127; shapes."""
    gen = torch.Generator().manual_seed(seed)
    x = with_special_rows(randn(6, 200, gen=gen) * 3).to(dtype).view(2, 3, 200)
    xq, scale = quant_per_token_ref(x)
    assert xq.shape == (6, 200) and xq.dtype == torch.int8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    x2 = x.reshape(6, 200).double()
    # Half a step, plus float32 rounding of the scaled value (|t| <= 127, ulp 2**-17 relative).
    assert bool(((dequant(xq, scale) - x2).abs() <= scale.double() * (0.5 + 1e-5)).all())
    assert torch.equal(xq.abs().amax(-1)[1:], torch.full((5,), 127, dtype=torch.int8))
    assert torch.equal(xq[0], torch.zeros(200, dtype=torch.int8)) and float(scale[0]) == 0.0
    assert xq[2, :6].tolist() == [127, 0, 2, 2, -2, 0], "ties must round half to even"


def test_int8_mm_int32_ref_is_exact() -> None:
    """float64 sums of int8 products against int64 integer arithmetic, past float32's 2**24."""
    gen = torch.Generator().manual_seed(7)
    k = 11008
    a = randint8(5, k, gen=gen)
    b = randint8(7, k, gen=gen)
    a[0], b[0] = 127, 127  # 11008 * 16129 = 177,548,032 > 2**24
    a[1], b[1] = -128, -128  # the largest sum an int8 product can reach at this K
    b[2] = torch.tensor([127, -128], dtype=torch.int8).repeat(k // 2)  # odd partial sums past 2**24
    a[3] = 127
    out = int8_mm_int32_ref(a, b)
    exact = a.long() @ b.long().t()
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), exact)
    assert int(exact.abs().max()) > 2**27


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_int8_matmul_ref_epilogue(bias: bool, seed: int) -> None:
    """The reference's output is the exact sums scaled in float32, then rounded once."""
    xq, xs, wq, ws, b = matmul_case(3, 56, 576, torch.Generator().manual_seed(seed), bias)
    exact = (xq.long() @ wq.long().t()).double() * xs.double() * ws.double()
    if b is not None:
        exact = exact + b.double()
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 4e-3)):
        out = int8_matmul_ref(xq, xs, wq, ws, b, dtype)
        assert out.dtype == dtype and out.shape == (3, 56)
        assert rel_err(out, exact) < tol  # one rounding: half an ulp, in norm well under one


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_w8a8_ref_against_float_gemm(dtype: torch.dtype, seed: int) -> None:
    """Quantized activations and per-channel weights reproduce x @ w.T within quantization noise."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(17, 576, gen=gen, dtype=dtype)
    w = randn(56, 576, gen=gen, dtype=dtype) * 0.05
    bias = randn(56, gen=gen, dtype=dtype) * 0.1
    wq, w_scale = quant_per_token_ref(w)  # per output channel = per row of [N, K]
    xq, x_scale = quant_per_token_ref(x)
    out = int8_matmul_ref(xq, x_scale, wq, w_scale.squeeze(1), bias, dtype)
    ref = x.double() @ w.double().t() + bias.double()
    assert out.dtype == dtype
    assert rel_err(out, ref) < W8A8_TOL


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rms_norm_quant_ref(dtype: torch.dtype, residual: bool, seed: int) -> None:
    """Dequantized codes within half a step of rms_norm's output; add_rms_norm's residual, exactly."""
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(2, 5, 576, gen=gen, dtype=dtype), randn(576, gen=gen, dtype=dtype)
    res = randn(2, 5, 576, gen=gen, dtype=dtype) if residual else None
    out = rms_norm_quant_ref(x, w, 1e-6, res)
    if res is None:
        assert len(out) == 2
        normed = rms_norm_ref(x, w, 1e-6)
    else:
        normed, new_res = add_rms_norm_ref(x, res, w, 1e-6)
        assert len(out) == 3 and torch.equal(out[2], new_res)
    xq, scale = out[:2]
    err = (dequant(xq, scale) - normed.reshape(10, 576).double()).abs()
    assert bool((err <= scale.double() * (0.5 + 1e-5)).all())


def test_per_token_scales_keep_outlier_free_rows_accurate(seed: int) -> None:
    x, rows = outlier_activations(8, 576, torch.Generator().manual_seed(seed), torch.float16)
    check_outliers(*quant_per_token_ref(x), x, rows)


# ------------------------------------------------------------------------------- interpreter: Triton


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k", [64, 200, 576])
def test_quant_per_token(k: int, dtype: torch.dtype, seed: int, forced: None) -> None:
    """The kernel gives the reference's codes and scales bit for bit (same float32 ops)."""
    gen = torch.Generator().manual_seed(seed)
    x = with_special_rows(randn(6, k + 5, gen=gen) * 2)[:, :k].to(dtype)  # rows strided wider than K
    assert_codes_close(quant_per_token(x), quant_per_token_ref(x))
    x3 = x.contiguous().view(2, 3, k)
    assert_codes_close(quant_per_token(x3), quant_per_token_ref(x3))
    assert_codes_close(quant_per_token(x[3:4]), quant_per_token_ref(x[3:4]))


@interp
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 200, 576])
def test_rms_norm_quant(hidden: int, dtype: torch.dtype, residual: bool, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(7, hidden + 3, gen=gen, dtype=dtype)[:, :hidden]  # strided rows
    x[0] = 0  # a zero row (with a residual, the residual row is what gets normalized)
    w = randn(hidden, gen=gen, dtype=dtype)
    res = randn(7, hidden, gen=gen, dtype=dtype) if residual else None
    out = rms_norm_quant(x, w, 1e-6, res)
    ref = rms_norm_quant_ref(x, w, 1e-6, res)
    assert len(out) == len(ref)
    if dtype != torch.bfloat16:
        assert_codes_close(out, ref, dtype)
        if res is not None:
            torch.testing.assert_close(out[2], ref[2], rtol=0, atol=0)  # one rounding of the same sum
    else:
        # The interpreter truncates the bf16 roundings that torch rounds to nearest (residual sum,
        # normalized row, times the weight): up to three one-sided errors of up to one bf16 ulp
        # (2**-7) each, half an ulp on average, which then move codes by one. A loose sanity bound;
        # the GPU cases check bf16 tightly.
        assert out[0].shape == ref[0].shape and int(out[0].min()) >= -127
        assert rel_err(dequant(*out[:2]), dequant(*ref[:2])) < 3e-2
        if res is not None:
            assert_close(out[2], ref[2], 1e-2)


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inter", [96, 200])
def test_silu_mul_quant(inter: int, dtype: torch.dtype, seed: int, forced: None) -> None:
    """The fused gate + quantizer against silu_and_mul then quant_per_token (the gate's exp may round
    differently from torch's: codes within one of the reference's)."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(6, 2 * inter + 5, gen=gen, dtype=dtype)[:, :2 * inter] * 3  # strided rows
    x[0] = 0
    out, ref = silu_mul_quant(x), silu_mul_quant_ref(x)
    if dtype != torch.bfloat16:
        assert_codes_close(out, ref, dtype)
    else:  # the interpreter truncates bf16 roundings (see test_rms_norm_quant)
        assert rel_err(dequant(*out), dequant(*ref)) < 3e-2
    err = (dequant(*ref) - silu_and_mul_ref(x).double()).abs()
    assert bool((err <= ref[1].double() * (0.5 + 1e-5)).all())


# (M, N, K): the odd shapes (one row, 3, 17 > 16, 2048; N not a tile multiple; K not a multiple
# of the K tile) at sizes the interpreter runs quickly.
INTERP_MATMUL = [(1, 8, 200), (3, 56, 576), (17, 4104, 200), (2048, 8, 576), (17, 56, 576)]


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", INTERP_MATMUL, ids=[f"m{m}_n{n}_k{k}" for m, n, k in INTERP_MATMUL])
def test_int8_matmul(m: int, n: int, k: int, dtype: torch.dtype, seed: int, forced: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    bias = (m + n) % 2 == 1  # half the shapes with a bias
    xq, xs, wq, ws, b = matmul_case(m, n, k, gen, bias)
    assert_close(int8_matmul(xq, xs, wq, ws, b, dtype), int8_matmul_ref(xq, xs, wq, ws, b, dtype), MATMUL_TOL[dtype])


@interp
@pytest.mark.parametrize("tiles", [(16, 16, 64), (32, 64, 32), (64, 32, 128)], ids=lambda t: "x".join(map(str, t)))
def test_int8_matmul_tilings(tiles: tuple[int, int, int], seed: int, poisoned_empty: None) -> None:
    """Explicit tiles: K a tile multiple (576 = 9 x 64 = 18 x 32, unmasked loop) and not (200),
    row and column tails, several row groups (GROUP_M) and a strided xq."""
    bm, bn, bk = tiles
    gen = torch.Generator().manual_seed(seed)
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, num_warps=4, num_stages=1)
    for m, n, k in ((150, 72, 576), (33, 40, 200)):
        xq_wide, xs, wq, ws, b = matmul_case(m, n, k + 8, gen, bias=True)
        xq, wq = xq_wide[:, :k], wq[:, :k].contiguous()
        out = int8_matmul_triton(xq, xs.view(-1), wq, ws, b, torch.float16, config=cfg)
        assert_close(out, int8_matmul_ref(xq, xs, wq, ws, b, torch.float16), MATMUL_TOL[torch.float16])


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_w8a8_layer(dtype: torch.dtype, seed: int, forced: None) -> None:
    """A W8A8 layer as the model runs it: add_rms_norm + quantize, then the int8 GEMM, against
    the float layer (rms_norm of the residual sum, then x @ w.T)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, n = 576, 200
    x, res = randn(9, hidden, gen=gen, dtype=dtype), randn(9, hidden, gen=gen, dtype=dtype)
    norm_w = (1 + 0.1 * randn(hidden, gen=gen)).to(dtype)
    w = randn(n, hidden, gen=gen, dtype=dtype) * 0.05
    wq, w_scale = quant_per_token(w)
    xq, x_scale, new_res = rms_norm_quant(x, norm_w, 1e-6, res)
    out = int8_matmul(xq, x_scale, wq, w_scale.view(-1), None, dtype)
    normed, ref_res = add_rms_norm_ref(x, res, norm_w, 1e-6)
    assert rel_err(out, normed.double() @ w.double().t()) < W8A8_TOL
    assert rel_err(new_res, ref_res) < MATMUL_TOL[dtype]


@interp
def test_outliers_triton(seed: int, forced: None) -> None:
    """Outlier rows through the kernels: per-token scales, and the GEMM rows stay accurate."""
    gen = torch.Generator().manual_seed(seed)
    x, rows = outlier_activations(20, 576, gen, torch.float16)
    xq, scale = quant_per_token(x)
    assert_codes_close((xq, scale), quant_per_token_ref(x), )
    check_outliers(xq, scale, x, rows)
    w = randn(56, 576, gen=gen) * 0.05
    wq, w_scale = quant_per_token(w)
    out = int8_matmul(xq, scale, wq, w_scale.view(-1), None, torch.float16).double()
    ref = x.double() @ (wq.double() * w_scale.double()).t()  # isolates the activations' error
    plain = [r for r in range(20) if r not in rows]
    err = (out - ref)[plain].norm(dim=-1) / ref[plain].norm(dim=-1)
    assert float(err.max()) < 2e-2  # ~0.7% rms noise per row, rows of only 56 outputs: 3x margin


@interp
def test_forced_triton_rejects_unsupported_inputs(forced: None) -> None:
    with pytest.raises(ValueError, match="quant_per_token"):
        quant_per_token(torch.ones(1, 65537))
    with pytest.raises(ValueError, match="int8_matmul"):
        int8_matmul(torch.ones(2, 8), torch.ones(2, 1), torch.ones(3, 8, dtype=torch.int8), torch.ones(3))


# -------------------------------------------------------------------------------- dispatch (any mode)


def test_auto_and_ref_modes_use_the_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors (auto) and in the ref mode, no Triton or cuBLAS path is reached."""

    def boom(*args, **kwargs):
        raise AssertionError("Triton launcher called")

    for name in ("quant_per_token_triton", "rms_norm_quant_triton", "int8_matmul_triton", "int8_matmul_int_mm"):
        monkeypatch.setattr(w8a8_mod, name, boom)
    monkeypatch.setattr(w8a8_mod, "INT_MM_MIN_ROWS", 1)
    x = torch.randn(3, 64)
    for mode in ("auto", "ref"):
        set_kernel_mode(mode)
        xq, scale = quant_per_token(x)
        rms_norm_quant(x, torch.ones(64), 1e-6)
        rms_norm_quant(x, torch.ones(64), 1e-6, x)
        int8_matmul(xq, scale, xq, scale.view(-1))


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cases run in this process")
def test_interpreter_cases_in_child() -> None:
    """Run this file's interpreter cases in a child process that imports triton interpreted."""
    run_interpreter_cases_in_child(__file__)


# -------------------------------------------------------------------------------------------------- GPU

GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_IDS = ["fp16", "bf16"]


@gpu
@compiled_gpu
def test_gpu_dispatch_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA tensors (auto mode) no reference runs; INT_MM_MIN_ROWS routes large M to cuBLAS."""
    set_kernel_mode("auto")

    def boom(*args, **kwargs):
        raise AssertionError("reference called on CUDA tensors")

    for name in ("quant_per_token_ref", "rms_norm_quant_ref", "int8_matmul_ref"):
        monkeypatch.setattr(w8a8_mod, name, boom)
    x = torch.randn(32, 64, device="cuda", dtype=torch.float16)
    xq, scale = quant_per_token(x)
    rms_norm_quant(x, torch.ones(64, device="cuda", dtype=torch.float16), 1e-6)
    int8_matmul(xq, scale, xq, scale.view(-1))
    calls = []
    monkeypatch.setattr(w8a8_mod, "INT_MM_MIN_ROWS", 17)
    monkeypatch.setattr(w8a8_mod, "int8_matmul_int_mm", lambda *a: calls.append(a[0].shape[0]))
    int8_matmul(xq, scale, xq, scale.view(-1))  # 32 rows: cuBLAS
    int8_matmul(xq[:16], scale[:16], xq, scale.view(-1))  # 16 rows: torch._int_mm cannot
    torch.cuda.synchronize()
    assert calls == [32]


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
def test_gpu_quant_per_token(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """Model-sized rows (hidden 4096, intermediate 11008, one odd width): codes and scales exact."""
    gen = torch.Generator().manual_seed(seed)
    for rows, k in ((2048, 4096), (257, 11008), (3, 200)):
        x = with_special_rows(randn(rows, k, gen=gen) * 3).to("cuda", dtype)
        assert_codes_close(quant_per_token(x), quant_per_token_ref(x), )
    x, outlier_rows = outlier_activations(2048, 4096, gen, dtype, "cuda")
    xq, scale = quant_per_token(x)
    assert_codes_close((xq, scale), quant_per_token_ref(x), )
    check_outliers(xq.cpu(), scale.cpu(), x.cpu(), outlier_rows)


@gpu
@compiled_gpu
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
def test_gpu_rms_norm_quant(dtype: torch.dtype, residual: bool, seed: int, poisoned_empty: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for rows, hidden in ((2048, 4096), (5, 576)):
        x = randn(rows, hidden, gen=gen, dtype=dtype, device="cuda")
        x[0] = 0
        w = randn(hidden, gen=gen, dtype=dtype, device="cuda")
        res = randn(rows, hidden, gen=gen, dtype=dtype, device="cuda") if residual else None
        out, ref = rms_norm_quant(x, w, 1e-6, res), rms_norm_quant_ref(x, w, 1e-6, res)
        assert_codes_close(out, ref, dtype)
        if res is not None:
            torch.testing.assert_close(out[2], ref[2], rtol=0, atol=0)


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
def test_gpu_silu_mul_quant(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for rows, inter in ((2048, 11008), (3, 96)):
        x = randn(rows, 2 * inter, gen=gen, dtype=dtype, device="cuda") * 3
        assert_codes_close(silu_mul_quant(x), silu_mul_quant_ref(x), dtype)


GPU_MATMUL = [(m, n, k) for m in (1, 3, 17, 2048) for n in (8, 56, 4104) for k in (576, 200)]


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
def test_gpu_int8_matmul_odd_shapes(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """The autotuned kernel on every odd shape (M 1/3/17/2048, N 8/56/4104, K 576/200), and the
    cuBLAS path where torch._int_mm takes the shape."""
    gen = torch.Generator().manual_seed(seed)
    for i, (m, n, k) in enumerate(GPU_MATMUL):
        args = matmul_case(m, n, k, gen, bias=i % 2 == 1, device="cuda")
        ref = int8_matmul_ref(*args, dtype)
        assert_close(int8_matmul_triton(*args, dtype), ref, GPU_MATMUL_TOL[dtype])
        if w8a8_mod.int_mm_problem(m, n, k) is None:
            assert_close(int8_matmul_int_mm(*args, dtype), ref, GPU_MATMUL_TOL[dtype])


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
def test_gpu_int8_matmul_llama_shapes(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """Llama-2-7B projections at decode and prefill row counts."""
    gen = torch.Generator().manual_seed(seed)
    for k, n in ((4096, 12288), (11008, 4096)):
        for m in (1, 16, 64, 256, 2048):
            args = matmul_case(m, n, k, gen, bias=False, device="cuda")
            assert_close(int8_matmul(*args, dtype), int8_matmul_ref(*args, dtype), GPU_MATMUL_TOL[dtype])


@gpu
@compiled_gpu
def test_gpu_every_matmul_config(seed: int, poisoned_empty: None) -> None:
    """Each candidate tile of MATMUL_CONFIGS computes the same product (an odd shape: masked K, row
    and column tails); a configuration that does not fit the GPU is what the autotuner skips."""
    from triton.runtime.errors import OutOfResources

    gen = torch.Generator().manual_seed(seed)
    args = matmul_case(300, 4104, 200, gen, bias=True, device="cuda")
    ref = int8_matmul_ref(*args, torch.float16)
    ran = 0
    for configs in MATMUL_CONFIGS.values():
        for cfg in configs:
            try:
                out = int8_matmul_triton(*args, torch.float16, config=cfg)
            except OutOfResources:
                continue
            assert_close(out, ref, GPU_MATMUL_TOL[torch.float16])
            ran += 1
    assert ran >= len(MATMUL_CONFIGS)


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=GPU_IDS)
def test_gpu_w8a8_layer_with_outliers(dtype: torch.dtype, seed: int, poisoned_empty: None) -> None:
    """rms_norm_quant + int8_matmul at Llama size, activations with outlier rows, against fp64."""
    gen = torch.Generator().manual_seed(seed)
    x, outlier_rows = outlier_activations(2048, 4096, gen, dtype, "cuda")
    res = randn(2048, 4096, gen=gen, dtype=dtype, device="cuda")
    norm_w = (1 + 0.1 * randn(4096, gen=gen)).to("cuda", dtype)
    w = randn(4096, 4096, gen=gen, dtype=dtype, device="cuda") * 0.02
    wq, w_scale = quant_per_token(w)
    xq, x_scale, new_res = rms_norm_quant(x, norm_w, 1e-6, res)
    out = int8_matmul(xq, x_scale, wq, w_scale.view(-1), None, dtype)
    normed, ref_res = add_rms_norm_ref(x, res, norm_w, 1e-6)
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
    plain = [r for r in range(2048) if r not in outlier_rows]
    assert rel_err(out[plain], (normed.double() @ w.double().t())[plain]) < W8A8_TOL
