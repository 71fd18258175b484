"""The segmented LoRA kernels (``kernels/lora.py``) against their torch references, and the
references against a per-row loop, on fresh random inputs: segments of unequal lengths, empty
ones and padding (slot -1), rows in no segment (left alone), fused parts of unequal sizes, split K.
Interpreter cases on the CPU (small sizes); GPU cases at Llama-2-7B sizes."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import assert_close, compiled_gpu, gpu, interp, run_interpreter_cases_in_child

from conveyor.kernels.lora import (
    LaunchPlan,
    LoRASegments,
    launch_plan,
    lora_expand,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink,
    lora_shrink_ref,
    lora_shrink_triton,
)


def segments(row_slots: list[int], device, padding: int = 0, empty_slot: int | None = None,
             max_len: int | None = None) -> LoRASegments:
    """Rows grouped by slot (slot -1: in no segment), plus an empty segment of ``empty_slot`` (a
    real slot with no rows) in the middle, ``padding`` empty segments of slot -1 at the end, and
    ``max_len`` (default: the longest segment) as a decode graph passes it (its batch size)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    groups = list(by_slot.items())
    if empty_slot is not None:
        groups.insert(len(groups) // 2, (empty_slot, []))
    order, starts = [], [0]
    for _, rows in groups:
        order += rows
        starts.append(len(order))
    slots = [slot for slot, _ in groups] + [-1] * padding
    starts += [starts[-1]] * padding
    longest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    t = lambda v: torch.tensor(v or [0], dtype=torch.int32, device=device)
    return LoRASegments(t(order), t(starts), torch.tensor(slots, dtype=torch.int32, device=device),
                        max_len or max(longest, 1))


def per_row(x, a, b, y, row_slots, part_sizes):
    """The naive result: each row with a slot, on its own."""
    out = y.float().clone()
    rank = b.shape[2]
    for t, slot in enumerate(row_slots):
        if slot < 0:
            continue
        low = x[t].float() @ a[slot].float().t()
        col = 0
        for p, size in enumerate(part_sizes):
            out[t, col:col + size] += low[p * rank:(p + 1) * rank] @ b[slot, col:col + size].float().t()
            col += size
    return out.to(y.dtype)


def case(t, k, part_sizes, rank, slots, dtype, device, gen, none_every=4):
    parts = len(part_sizes)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    a = (torch.randn(slots, parts * rank, k, generator=gen) / k ** 0.5).to(device, dtype)
    b = torch.randn(slots, sum(part_sizes), rank, generator=gen).to(device, dtype)
    y = torch.randn(t, sum(part_sizes), generator=gen).to(device, dtype)
    row_slots = [-1 if i % none_every == none_every - 1 else int(torch.randint(0, slots, (1,), generator=gen))
                 for i in range(t)]
    return x, a, b, y, row_slots


def test_the_references_equal_a_per_row_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    for part_sizes in ((48,), (32, 64), (64, 32, 32)):
        x, a, b, y, row_slots = case(11, 40, part_sizes, 16, 3, torch.float32, "cpu", gen)
        seg = segments(row_slots, "cpu", padding=2, empty_slot=1)
        out = y.clone()
        lora_expand_ref(out, lora_shrink_ref(x, a, seg), b, seg, part_sizes)
        assert_close(out, per_row(x, a, b, y, row_slots, part_sizes), 1e-6)
        untouched = [i for i, s in enumerate(row_slots) if s < 0]
        assert torch.equal(out[untouched], y[untouched])


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _check(t, k, part_sizes, rank, slots, dtype, device, split_k=None, tol=None, max_len=None, padding=1):
    gen = torch.Generator().manual_seed(t * 131 + k + rank)
    x, a, b, y, row_slots = case(t, k, part_sizes, rank, slots, dtype, device, gen)
    seg = segments(row_slots, device, padding=padding, empty_slot=slots - 1, max_len=max_len)
    partial = lora_shrink_triton(x, a, seg, split_k)
    if split_k is not None:
        assert partial.shape[0] == split_k
    ref_partial = lora_shrink_ref(x, a, seg)
    rows = torch.tensor([i for i, s in enumerate(row_slots) if s >= 0], device=device)
    assert_close(partial.sum(0)[rows], ref_partial.sum(0)[rows], 1e-5 if dtype == torch.float32 else 2e-3)
    out = y.clone()
    lora_expand_triton(out, partial, b, seg, part_sizes)
    ref = y.clone()
    lora_expand_ref(ref, ref_partial, b, seg, part_sizes)
    assert_close(out - y, ref - y, tol or TOL[dtype])  # the delta alone: y's own size hides nothing
    untouched = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(out[untouched], y[untouched])  # rows in no segment are never written


@interp
@pytest.mark.parametrize("part_sizes", [(32,), (32, 16), (32, 16, 16)])
@pytest.mark.parametrize("split_k", [1, 2])
def test_triton_matches_the_reference_interpreted(part_sizes, split_k) -> None:
    _check(9, 128, part_sizes, 16, 3, torch.float32, "cpu", split_k=split_k)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_rank_32_half_precision_interpreted(dtype) -> None:
    _check(20, 64, (16, 48), 32, 2, dtype, "cpu")


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_graph_shaped_launch_interpreted(dtype) -> None:
    # A decode graph's launch: max_len is the batch size, the slots' segments are short, some
    # empty, trailing ones padding; K split 3 ways of 128-column steps; rank 48 (not a power of
    # two) over 3 parts makes N = 144, two shrink column tiles.
    _check(12, 768, (16, 32, 16), 48, 3, dtype, "cpu", split_k=3, max_len=12, padding=3)


@interp
def test_dispatchers_run_triton_when_forced_interpreted(forced) -> None:
    gen = torch.Generator().manual_seed(7)
    x, a, b, y, row_slots = case(6, 64, (32, 16), 16, 2, torch.float16, "cpu", gen)
    seg = segments(row_slots, "cpu", padding=1)
    out, ref = y.clone(), y.clone()
    lora_expand(out, lora_shrink(x, a, seg, split_k=2), b, seg, (32, 16))
    lora_expand_ref(ref, lora_shrink_ref(x, a, seg), b, seg, (32, 16))
    assert_close(out - y, ref - y, TOL[torch.float16])
    with pytest.raises(ValueError, match="multiples of 16"):  # forced: no silent fallback
        lora_expand(out, lora_shrink(x, a, seg), b, seg, (40, 8))


def test_dispatchers_take_the_reference_for_cpu_tensors() -> None:
    gen = torch.Generator().manual_seed(3)
    x, a, b, y, row_slots = case(5, 32, (16,), 16, 2, torch.float32, "cpu", gen)
    seg = segments(row_slots, "cpu")
    partial = lora_shrink(x, a, seg)
    assert torch.equal(partial, lora_shrink_ref(x, a, seg))
    out, ref = y.clone(), y.clone()
    lora_expand(out, partial, b, seg, (16,))
    lora_expand_ref(ref, partial, b, seg, (16,))
    assert torch.equal(out, ref)


def test_launch_plan() -> None:
    # Batch 1 decode, q|k|v at rank 16 (N = 48), K = 4,096 on 132 SMs: 16 splits of 256 columns.
    assert launch_plan(1, 1, 1, 4096, 48, 132) == LaunchPlan(16, 64, 128, 16, 4)
    # Batch 64 over 8 slots in a graph (max_len = 64): ~11 busy row blocks, not 32.
    assert launch_plan(64, 64, 8, 4096, 48, 132).split_k == 12
    assert launch_plan(2048, 2048, 1, 4096, 48, 132).split_k == 1  # prefill: no split
    assert launch_plan(2048, 2048, 1, 4096, 256, 132) == LaunchPlan(64, 128, 128, 1, 8)
    assert launch_plan(1, 1, 1, 128, 16, 132).split_k == 1  # short K: not below 256 columns a split
    assert launch_plan(1, 1, 1, 4096, 48, 132, split_k=3).split_k == 3


@compiled_gpu
def test_interpreter_cases_in_child() -> None:
    run_interpreter_cases_in_child(__file__)


@gpu
@pytest.mark.parametrize("t", [1, 8, 64, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4096, (4096, 1024, 1024)), (4096, (11008, 11008)), (11008, (4096,))])
def test_triton_matches_the_reference_on_the_gpu(t, dtype, shape) -> None:
    k, part_sizes = shape
    _check(t, k, part_sizes, 16, 8, dtype, "cuda")


@gpu
@pytest.mark.parametrize("rank", [16, 64])
def test_decode_graph_sizes_on_the_gpu(rank) -> None:
    _check(64, 4096, (4096, 4096, 4096), rank, 8, torch.float16, "cuda", max_len=64, padding=4)


@gpu
def test_float32_keeps_ieee_products_on_the_gpu() -> None:
    _check(33, 256, (64, 64), 16, 3, torch.float32, "cuda", tol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot", [2, -1])
def test_the_gemv_adds_one_rows_delta_in_its_epilogue(dtype, slot) -> None:
    """Batch-1 decode: the GEMV with a LoRA epilogue equals F.linear plus the expand (slot -1: the
    base alone)."""
    from conveyor.kernels.gemv import GemvLoRA, gemv_triton

    gen = torch.Generator().manual_seed(7)
    part_sizes, k, rank = (4096, 1024, 1024), 4096, 16
    x, a, b, _, _ = case(1, k, part_sizes, rank, 4, dtype, "cuda", gen)
    w = (torch.randn(sum(part_sizes), k, generator=gen) / k ** 0.5).to("cuda", dtype)
    seg = segments([slot], "cuda", padding=3)
    partial = lora_shrink_triton(x, a, seg)
    out = gemv_triton(x, w, lora=GemvLoRA(seg, partial, b, part_sizes))
    ref = torch.nn.functional.linear(x, w)
    lora_expand_ref(ref, lora_shrink_ref(x, a, seg), b, seg, part_sizes)
    assert_close(out, ref, 1e-2)
