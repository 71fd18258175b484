"""A step's rows grouped by LoRA slot: what the segmented kernels (``kernels/lora.py``) read.

Host lists only (the runner and the decode graphs copy them to the device in one piece): the
rows of each slot in turn (``order``), where each slot's run starts (``starts``, one more entry
than slots) and the slots themselves. Rows without an adapter (slot -1) are in no segment: the
kernels leave their outputs alone.
"""

from __future__ import annotations

import torch

from ...kernels.lora import LoRASegments


def group_rows(ranges: list[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    """``(first row, rows, slot)`` runs -> (row order, segment starts, segment slots), segments in
    order of first appearance; runs of slot -1 are left out."""
    by_slot: dict[int, list[int]] = {}
    for first, count, slot in ranges:
        if slot >= 0:
            by_slot.setdefault(slot, []).extend(range(first, first + count))
    order, starts = [], [0]
    for rows in by_slot.values():
        order.extend(rows)
        starts.append(len(order))
    return order, starts, list(by_slot)


def step_segments(ranges: list[tuple[int, int, int]], device: torch.device) -> LoRASegments | None:
    """The device segments of an eager step's ``(first row, rows, slot)`` runs (None when no row
    has an adapter): one host-to-device copy."""
    order, starts, slots = group_rows(ranges)
    if not slots:
        return None
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    host = torch.tensor(order + starts + slots, dtype=torch.int32)
    if device.type == "cuda":
        buf = host.pin_memory().to(device, non_blocking=True)
    else:
        buf = host.to(device)
    n, s = len(order), len(slots)
    return LoRASegments(buf[:n], buf[n:n + s + 1], buf[n + s + 1:], longest)
