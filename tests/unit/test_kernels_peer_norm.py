"""The fused all-reduce + residual add + RMSNorm kernel (``kernels/peer_norm.py``) against its
reference on fresh random inputs: the peers' slots are tensors of this process (the barrier off;
on the GPU also on, at world size 1, where a rank signals itself). Two ranks on two GPUs:
tests/integration/test_tp_two_gpus.py."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import assert_close, compiled_gpu, gpu, interp, ptx_of, run_interpreter_cases_in_child

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


def test_a_peers_row_is_read_sixteen_bytes_at_a_time() -> None:
    """The peers' rows arrive over NVLink: each thread reads its columns of a bf16 row of 4096 in
    16-byte vector loads (still volatile: the barrier orders them), not 2-byte ones, which the
    kernel got while the slot's address, loaded as an integer, had no known alignment (a hidden
    size that is a multiple of 16, as the launch specializes 4096, keeps every row aligned)."""
    import re

    ptx = ptx_of("conveyor.kernels.peer_norm", "_peer_add_rms_norm_kernel",
                 {"slot_ptrs": "*i64", "flag_ptrs": "*i64", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                  "res_out_ptr": "*bf16", "stride_res": "i32", "stride_out": "i32", "stride_res_out": "i32",
                  "hidden": "i32:16", "eps": "fp32", "rank": "i32", "WORLD": "constexpr", "BARRIER": "constexpr",
                  "BLOCK": "constexpr", "PDL_TRIGGER": "constexpr"},
                 {"WORLD": 2, "BARRIER": True, "BLOCK": 4096, "PDL_TRIGGER": True}, num_warps=8)
    peer_loads = re.findall(r"ld\.volatile\.global\.(\S+)", ptx)
    # 4096 columns x 2 ranks over 256 threads: 32 columns a thread, four 16-byte loads.
    assert peer_loads and all(width == "v4.b32" for width in peer_loads), peer_loads
    assert len(peer_loads) == 4
    # On Hopper the GEMV after it may launch while it waits for the peers (programmatic dependent launch).
    assert "griddepcontrol.launch_dependents" in ptx
