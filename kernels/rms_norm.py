"""RMSNorm, optionally fused with the residual add that precedes it."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import FLOAT_DTYPES, gdc_launch_dependents, jit, next_pow2, pdl_trigger, tl, triton_takes


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in float32 like Hugging Face's LlamaRMSNorm."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


MAX_HIDDEN = 65536  # the row kernels (here and in w8a8.py) hold a whole row in registers


def row_warps(block: int) -> int:
    """Warps of a one-row-a-program kernel over ``block`` columns: 8-32 elements per thread in
    flight keeps a row's loads wide without spilling."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@jit
def normed_row(
    x_ptr, res_ptr, w_ptr, res_out_ptr, stride_x, stride_res, stride_res_out, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row ``program_id(0)`` of ``weight * rms_norm(x [+ residual])`` in fp32, the sum stored to
    ``res_out`` when HAS_RESIDUAL: returns (row, cols, mask, values). Shared by the kernel below
    and ``w8a8._rms_norm_quant_kernel``, which quantizes the row instead of storing it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # The reference adds in the tensors' dtype (one rounding), then normalizes that sum.
        summed = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        x = summed
    return row, cols, mask, scaled_norm(x, w_ptr, cols, mask, hidden, eps)


@jit
def scaled_norm(x, w_ptr, cols, mask, hidden, eps):
    """``weight * rms_norm(x)`` of one row ``x`` (its dtype the reference's), in fp32, rounded
    where the reference rounds. Shared by ``normed_row`` and ``peer_norm``'s fused kernel."""
    xf = x.to(tl.float32)
    # Correctly rounded sqrt and division (once per row): closer to torch.rsqrt than the approximations.
    rstd = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.math.sqrt_rn(tl.sum(xf * xf, axis=0) / hidden + eps))
    # Like the reference: round the normalized row to the input dtype, then scale by the weight.
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return normed * w


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False,
):
    # Grid: (rows,); one program normalizes one whole row (BLOCK >= hidden), so one read of x.
    if PDL_TRIGGER:  # the GEMV after this norm may start fetching its weights (_triton.pdl_trigger)
        gdc_launch_dependents()
    row, cols, mask, y = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, stride_x, stride_res, stride_res_out,
                                     hidden, eps, HAS_RESIDUAL, BLOCK)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] as a 2-D [rows, hidden] tensor with unit stride along hidden."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def norm_inputs(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """Checked kernel operands of an (add_)rms_norm launch: ``(x2, r2, w, res_out, normed_dtype)``,
    rows as 2-D unit-stride tensors, ``res_out`` the new residual's buffer (without a residual,
    ``r2`` and ``res_out`` are ``x2``: valid pointers the kernel does not use)."""
    hidden = x.shape[-1]
    assert x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, f"unsupported dtypes {x.dtype}, {weight.dtype}"
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} does not match hidden size {hidden}"
    assert weight.device == x.device, "weight and x on different devices"
    x2 = as_rows(x)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    if residual is None:
        return x2, x2, w, x2, x.dtype
    assert residual.shape == x.shape and residual.device == x.device, "residual must match x"
    assert residual.dtype in FLOAT_DTYPES, f"unsupported residual dtype {residual.dtype}"
    res_dtype = torch.result_type(x, residual)
    return x2, as_rows(residual), w, torch.empty(x2.shape, dtype=res_dtype, device=x.device), res_dtype


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2, r2, w, res_out, normed_dtype = norm_inputs(x, residual, weight)
    # The reference multiplies ``weight * normed``: the product's dtype follows torch promotion.
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, normed_dtype), device=x.device)
    if x2.shape[0]:
        block = next_pow2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, w, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, PDL_TRIGGER=pdl_trigger(x2), num_warps=row_warps(block),
        )
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if residual is not None else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton launcher for :func:`rms_norm_ref`."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`add_rms_norm_ref`: one pass computes the sum and its norm."""
    out, res = _launch(x, residual, weight, eps)
    assert res is not None
    return out, res


def _problem(*tensors: torch.Tensor) -> str | None:
    x = tensors[0]
    supported = all(t.dtype in FLOAT_DTYPES for t in tensors) and x.shape[-1] <= MAX_HIDDEN
    return None if supported else f"{x.dtype} {tuple(x.shape)}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: Triton on CUDA, else the reference."""
    if triton_takes("rms_norm", (x,), _problem, x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``residual = x + residual; (rms_norm(residual), residual)``: Triton on CUDA, else the reference."""
    if triton_takes("add_rms_norm", (x, residual), _problem, x, residual, weight):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
