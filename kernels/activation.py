"""SiLU-and-multiply: the gate of a SwiGLU MLP over a fused [gate | up] projection."""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch
import torch.nn.functional as F

from ._triton import FLOAT_DTYPES, cdiv, gdc_launch_dependents, jit, pdl_trigger, row_and_cols, tl, triton_takes


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] = cat(gate, up) -> silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter_size,
    BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False,
):
    # Grid: (rows, cdiv(I, BLOCK)); each program gates BLOCK columns of one row.
    if PDL_TRIGGER:  # the down projection may start fetching its weights (_triton.pdl_trigger)
        gdc_launch_dependents()
    row, cols = row_and_cols(BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    # Round silu(gate) to the input dtype before the product, as the reference's two torch ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher for :func:`silu_and_mul_ref` (same shapes and dtype)."""
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    assert x.shape[-1] % 2 == 0, "last dim must be 2*I"
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel():
        block = 1024
        grid = (x2.shape[0], cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, PDL_TRIGGER=pdl_trigger(x2), num_warps=4
        )
    return out.view(*x.shape[:-1], inter)


def _problem(x: torch.Tensor) -> str | None:
    return None if x.dtype in FLOAT_DTYPES and x.shape[-1] % 2 == 0 else f"{x.dtype} {tuple(x.shape)}"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over ``x = cat(gate, up)`` on the last dim: Triton on CUDA, else the reference."""
    if triton_takes("silu_and_mul", (x,), _problem, x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
