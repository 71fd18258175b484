"""The fused all-reduce + residual add + RMSNorm kernel (``kernels/peer_norm.py``) against its
reference on fresh random inputs: the peers' slots are tensors of this process (the barrier off;
on the GPU also on, at world size 1, where a rank signals itself). Two ranks on two GPUs:
tests/integration/test_tp_two_gpus.py."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child

from conveyor.kernels.peer_norm import peer_add_rms_norm_ref, peer_add_rms_norm_triton


def _case(device, dtype, world, rows, hidden, barrier=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(rows, hidden, generator=gen).to(device, dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    slots = [torch.zeros(rows + 3, hidden, dtype=dtype, device=device) for _ in range(world)]  # room past rows
    for s, p in zip(slots, partials):
        s[:rows] = p
    flags = torch.zeros(world, max(rows, 1) * world, dtype=torch.int32, device=device)
    slot_ptrs = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64, device=device)
    flag_ptrs = torch.tensor([flags[r].data_ptr() for r in range(world)], dtype=torch.int64, device=device)
    out, res = peer_add_rms_norm_triton(slot_ptrs, flag_ptrs, 0, rows, residual, weight, 1e-5, barrier=barrier)
    ref_out, ref_res = peer_add_rms_norm_ref(partials, residual, weight, 1e-5)
    return (out, res), (ref_out, ref_res), flags


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world, rows, hidden", [(2, 3, 64), (4, 1, 48), (2, 5, 100)])
def test_interpreted_kernel_matches_the_reference(dtype, world, rows, hidden) -> None:
    (out, res), (ref_out, ref_res), _ = _case("cpu", dtype, world, rows, hidden)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close(res, ref_res, tol)
    assert_close(out, ref_out, tol)


@compiled_gpu
def test_interpreter_cases_in_child() -> None:
    run_interpreter_cases_in_child(__file__)


@gpu
@compiled_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world, rows, barrier", [(2, 1, False), (2, 64, False), (1, 1, True), (1, 128, True)])
def test_gpu_kernel_matches_the_reference(dtype, world, rows, barrier) -> None:
    (out, res), (ref_out, ref_res), flags = _case("cuda", dtype, world, rows, 4096, barrier=barrier)
    torch.cuda.synchronize()
    assert torch.equal(res, ref_res)  # the same roundings in the same order: bitwise
    assert_close(out, ref_out, 2e-3)
    assert int(flags.abs().sum()) == 0  # every flag taken back: the next call starts clean
