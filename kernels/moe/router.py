"""Router logits in float32 from a 16-bit hidden state: ``x.float() @ w.T`` with ``w`` [E, H]
float32 (``engine/layers/moe.py``'s ``Router``).

For a decode step's few tokens, torch runs this as a cast of ``x`` and cuBLAS's fp32 GEMV (a dot
kernel and a reduction): three launches, ~7 µs a layer at batch 1 (Qwen3-30B-A3B). The kernel here
reads ``x`` in its own dtype and is one launch: a program per (token, ``BLOCK_E`` experts), the
hidden dim walked in ``BLOCK_H`` chunks with fp32 products and sums. Past ``KERNEL_MAX_TOKENS``
tokens each program would re-read the weight from L2 per token; cuBLAS's GEMM is the better tool.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch
import torch.nn.functional as F

from .._triton import cdiv, jit, tl, triton_takes

KERNEL_MAX_TOKENS = 16
_BLOCK_H = 256


def router_logits_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H] (any float dtype), w [E, H] float32 -> [T, E] float32."""
    return F.linear(x.float(), w)


@jit
def _router_kernel(x, w, out, hidden, num_experts, stride_x, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h_ok = h0 + cols < hidden
        xs = tl.load(x + t * stride_x + h0 + cols, mask=h_ok, other=0.0).to(tl.float32)
        ws = tl.load(w + experts[:, None].to(tl.int64) * hidden + h0 + cols[None, :],
                     mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        acc += tl.sum(ws * xs[None, :], axis=1)
    tl.store(out + t * num_experts + experts, acc, mask=e_ok)


def router_logits_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``router_logits_ref`` as one kernel."""
    num_tokens, hidden = x.shape
    num_experts = w.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    # Enough programs to spread the weight's read over the GPU at one token: 4 experts a program
    # for E >= 64, else 1-2.
    block_e = 4 if num_experts >= 64 else 2 if num_experts >= 16 else 1
    if num_tokens:
        _router_kernel[(num_tokens, cdiv(num_experts, block_e))](
            x, w, out, hidden, num_experts, x.stride(0), BLOCK_E=block_e, BLOCK_H=_BLOCK_H, num_warps=4)
    return out


def _problem(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if w.dtype != torch.float32 or not w.is_contiguous():
        return f"router weight {w.dtype}, contiguous={w.is_contiguous()} (a contiguous float32 weight only)"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype}"
    return None


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``router_logits_ref``'s result: the kernel on CUDA up to ``KERNEL_MAX_TOKENS`` tokens, else torch."""
    if x.shape[0] <= KERNEL_MAX_TOKENS and triton_takes("router_logits", (x, w), _problem, x, w):
        return router_logits_triton(x, w)
    return router_logits_ref(x, w)
