"""Tensor parallel's all-reduce fused with the residual add and RMSNorm that follow it.

At decode, every row-parallel linear (o_proj, down_proj) ends in an all-reduce of a few KB, and
the next thing the layer does is ``residual += sum; normed = rms_norm(residual)``. Here that is
one kernel: each rank has written its partial sum into its slot of a buffer every rank can read
(torch symmetric memory: the peers' buffers are mapped into this process over NVLink); program
``row`` tells every peer its row is there, waits until every peer has said the same, then reads
row ``row`` of every rank's slot, sums them in rank order (so every rank gets the same bits),
adds the residual and normalizes, all in registers. No NCCL launch, no copy back, no second
kernel for the norm.

The barrier is per row: a flag for each (row, source rank) in every rank's flag array. A rank
sets ``flags[peer][row, me]`` from 0 to 1 (compare-and-swap, release, system scope; it spins
while the peer has not yet taken the previous call's flag) and takes its own
``flags[me][row, peer]`` from 1 back to 0 (acquire). Every flag is 0 again when the call ends,
so the next call, a CUDA graph replay included, starts clean. Consecutive calls use different
slots (the caller's ring of slots), so a rank never overwrites a slot a slower peer still reads:
to write slot s again it must have passed the barrier of a later call, which its peers reach
only after reading s. Every program of a grid must be resident at once (rows <= a few hundred,
one small program a row), or two ranks could wait on programs the other has not started.

The reference: the ranks' partials summed in the dtype (what NCCL's all-reduce gives), then
``add_rms_norm_ref``.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` annotations as objects.

import torch

from ._triton import gdc_launch_dependents, jit, next_pow2, pdl_trigger, tl
from .rms_norm import add_rms_norm_ref, row_warps, scaled_norm


def peer_add_rms_norm_ref(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum(partials) + residual), sum(partials) + residual)``: the all-reduce's sum
    rounded to the dtype (summed in float32 in rank order), then ``add_rms_norm_ref``."""
    total = torch.stack([p.float() for p in partials]).sum(0).to(partials[0].dtype)
    return add_rms_norm_ref(total, residual, weight, eps)


@jit
def _peer_add_rms_norm_kernel(
    slot_ptrs, flag_ptrs, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_res, stride_out, stride_res_out, hidden, eps, rank,
    WORLD: tl.constexpr, BARRIER: tl.constexpr, BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False,
):
    # Grid: (rows,). slot_ptrs: int64 [WORLD], each rank's slot (rows of ``hidden``, unit stride)
    # as an address in this process; flag_ptrs: int64 [WORLD], each rank's int32 flags.
    if PDL_TRIGGER:
        # The GEMV after this norm (programmatic dependent launch) may start fetching its weights
        # while this program waits for the peers: every program of the grid is resident by then
        # (the trigger counts only when all have reached it), so none waits behind the GEMV.
        gdc_launch_dependents()
    row = tl.program_id(0)
    dtype = res_out_ptr.dtype.element_ty
    if BARRIER:
        for peer in tl.static_range(WORLD):
            theirs = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + row * WORLD + rank
            seen = tl.atomic_cas(theirs, 0, 1, sem="release", scope="sys")
            while seen != 0:
                seen = tl.atomic_cas(theirs, 0, 1, sem="release", scope="sys")
        mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32)) + row * WORLD
        for peer in tl.static_range(WORLD):
            seen = tl.atomic_cas(mine + peer, 1, 0, sem="acquire", scope="sys")
            while seen != 1:
                seen = tl.atomic_cas(mine + peer, 1, 0, sem="acquire", scope="sys")
    row64 = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        # Every slot starts on a 16-byte boundary (FusedNormAllReduce): said here, since an
        # address loaded as an integer has no known alignment, and without it each thread reads
        # its columns of the peer's row over NVLink two bytes at a time instead of sixteen.
        slot = tl.multiple_of(tl.load(slot_ptrs + peer).to(tl.pointer_type(dtype)), 16)
        total += tl.load(slot + row64 * hidden + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
    # As the reference: the all-reduce's sum rounded to the dtype, plus the residual rounded again.
    res = tl.load(res_ptr + row64 * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (total.to(dtype).to(tl.float32) + res).to(dtype)
    tl.store(res_out_ptr + row64 * stride_res_out + cols, summed, mask=mask)
    y = scaled_norm(summed, w_ptr, cols, mask, hidden, eps)
    tl.store(out_ptr + row64 * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def peer_add_rms_norm_triton(
    slot_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, rank: int, rows: int, residual: torch.Tensor,
    weight: torch.Tensor, eps: float, barrier: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel over the first ``rows`` rows of every rank's slot (each already
    holds that rank's partial sum, ``[rows, hidden]`` of ``residual``'s dtype). ``slot_ptrs`` /
    ``flag_ptrs``: int64 tensors of ``world`` addresses on the launch device. ``barrier`` False
    (tests on one device, the peers' slots already written) skips the flags."""
    hidden = residual.shape[-1]
    res = residual.reshape(-1, hidden)
    assert res.shape[0] == rows and res.stride(-1) == 1, "residual must be [rows, hidden] with unit stride"
    assert weight.shape == (hidden,) and weight.is_contiguous()
    out = torch.empty(res.shape, dtype=torch.promote_types(weight.dtype, res.dtype), device=res.device)
    res_out = torch.empty_like(res)
    if rows:
        block = next_pow2(hidden)
        _peer_add_rms_norm_kernel[(rows,)](
            slot_ptrs, flag_ptrs, res, weight, out, res_out,
            res.stride(0), out.stride(0), res_out.stride(0), hidden, float(eps), rank,
            WORLD=slot_ptrs.numel(), BARRIER=barrier, BLOCK=block, PDL_TRIGGER=pdl_trigger(res),
            num_warps=row_warps(block),
        )
    return out.view(residual.shape), res_out.view(residual.shape)
