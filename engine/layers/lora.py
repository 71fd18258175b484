"""LoRA beside a linear layer: each token's adapter delta ``(x A^T) B^T``, from a pool of slots.

Many adapters share one base model (S-LoRA): every adapter the engine may run sits in one of
``num_slots`` slots of each target linear's ``LoRASlots`` (``a`` [slots, parts * R, in],
``b`` [slots, out, R]; the adapter's scaling is folded into ``b``, a smaller rank is zero-padded
to the pool's ``R``, which adds nothing). The linear asks its ``LoRASlots`` to ``begin`` before its base
product and to ``apply`` after: the tokens are grouped into segments by slot
(``kernels/lora.LoRASegments``, set for the forward by the model runner, like the attention
metadata), one shrink ``x A^T`` and one expand ``+= low B^T`` per linear, each segment with its own
slot's weights. On CUDA the deltas stay off the base's path where they can: a one-row step
(batch-1 decode) of a dense linear runs the shrink and lets the GEMV add the delta in its epilogue;
larger steps compute the deltas on a side stream beside the base GEMM and add them after. Steps
(or graph replays) without adapter tokens set no segments: the layers skip it all.

A fused linear (q|k|v, gate|up) holds one adapter block per part: part ``p``'s ``A`` is rows
``p*R:(p+1)*R`` of ``a`` (all read the same input), its ``B`` the part's output rows of ``b``.

Tensor parallel splits the adapters as their linears are split (``engine/distributed.py``): a
column-parallel linear (outputs split) keeps ``A`` whole and its part of ``B``'s rows; a
row-parallel one (inputs split: o_proj, down_proj) its columns of ``A`` and all of ``B``, and adds
``x_r A_r^T B^T`` to its partial output before the all-reduce, which sums the ranks' parts into
``x A^T B^T`` as it sums the base's.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
from torch import nn

from ...kernels.gemv import LAYER_ROWS, GemvLoRA, gemv
from ...kernels.lora import LoRASegments, lora_expand, lora_shrink
from .linear import LinearBase, MergedLinear, RowParallelLinear, UnquantizedLinearMethod

# Rows up to which a step's deltas run on a side stream beside the base GEMM (decode-sized steps,
# where the latency-bound LoRA kernels would add their whole time); a larger step (a prefill chunk)
# adds them in place after the base instead of holding a second [T, out] activation.
SIDE_STREAM_ROWS = 256
# Thread-local, as the attention metadata: several engines may step in one process.
_local = threading.local()


def set_lora_segments(segments: LoRASegments | None) -> None:
    """Install the adapter segments of the forward about to run (None: no adapter tokens)."""
    _local.segments = segments


def get_lora_segments() -> LoRASegments | None:
    """The running forward's adapter segments, or None."""
    return getattr(_local, "segments", None)


class After(NamedTuple):
    """Deltas to compute after the base linear, in place: its input rows."""

    x: torch.Tensor


class Beside(NamedTuple):
    """Deltas being computed on the side stream into ``delta`` [T, out]."""

    delta: torch.Tensor


Started = After | Beside | GemvLoRA  # what ``LoRASlots.begin`` hands ``apply``


class LoRASlots(nn.Module):
    """The adapter slots of one linear layer (this rank's share of them)."""

    def __init__(self, linear: LinearBase, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.rank = rank
        if isinstance(linear, MergedLinear):
            # Outputs split over ranks: this rank's part of each projection; inputs whole.
            self.part_sizes = tuple(linear.output_sizes)
            self.part_rows = [start for start, _ in linear.parts]  # where they start in the full projection
            self.full_part_sizes = tuple(linear.full_output_sizes)
            self.in_start, self.in_size, self.full_in = 0, linear.input_size, linear.input_size
        elif isinstance(linear, RowParallelLinear):
            # Inputs split over ranks: this rank's columns of A; every output.
            self.part_sizes = self.full_part_sizes = (linear.output_size,)
            self.part_rows = [0]
            self.in_start, self.in_size, self.full_in = linear.input_start, linear.input_size, linear.full_input_size
        else:
            self.part_sizes = self.full_part_sizes = (linear.output_size,)
            self.part_rows = [0]
            self.in_start, self.in_size, self.full_in = 0, linear.input_size, linear.input_size
        parts = len(self.part_sizes)
        # A dense linear's one-row steps (batch-1 decode) run the GEMV kernel, which adds the delta
        # in its epilogue: one shrink and no expand launch.
        self.fuse_gemv = isinstance(linear.method, UnquantizedLinearMethod) and LAYER_ROWS >= 1
        self.register_buffer("a", torch.zeros(num_slots, parts * rank, self.in_size, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, sum(self.part_sizes), rank, dtype=dtype, device=device),
                             persistent=False)

    def local_weights(self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's slot contents on this rank, from its whole-model ``{part: (A [r, in],
        B [out_part, r] scaled)}``: ``a`` [parts * R, in / tp-or-in] and ``b`` [out, R] in the
        pool's dtype; parts it does not target stay zero."""
        a = torch.zeros(self.a.shape[1:], dtype=self.a.dtype)
        b = torch.zeros(self.b.shape[1:], dtype=self.b.dtype)
        out = 0
        for p, size in enumerate(self.part_sizes):
            if p in parts:
                pa, pb = parts[p]
                r = pa.shape[0]
                a[p * self.rank: p * self.rank + r] = pa[:, self.in_start: self.in_start + self.in_size]
                b[out: out + size, :r] = pb[self.part_rows[p]: self.part_rows[p] + size]
            out += size
        return a, b

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one adapter's weights (``local_weights``, pinned on CUDA) into ``slot``; queued
        on the current stream, so a step still running reads the slot's old weights first."""
        nb = self.a.device.type == "cuda"
        self.a[slot].copy_(a, non_blocking=nb)
        self.b[slot].copy_(b, non_blocking=nb)

    def begin(self, x: torch.Tensor) -> Started | None:
        """Start this step's adapter deltas for input ``x`` before the base linear runs, or None
        when the step has no adapter rows. On CUDA: one row (batch-1 decode) of a dense linear
        gets its shrink here and its expand inside the GEMV (``GemvLoRA``); up to
        ``SIDE_STREAM_ROWS`` rows get both on a side stream, into a zeroed ``[T, out]`` buffer,
        beside the base GEMM (the small LoRA kernels are latency-bound and would otherwise add
        their whole time to every linear). Otherwise ``apply`` adds them after the base, in place."""
        segments = get_lora_segments()
        if segments is None:
            return None
        if not isinstance(x, torch.Tensor):  # W8A8's int8 rows (Int8Rows): the adapter reads them dequantized
            x = (x.q.to(torch.float32) * x.scale).to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.device.type != "cuda" or x2.shape[0] > SIDE_STREAM_ROWS:
            return After(x2)  # after the base, in place (a prefill chunk: no second [T, out] activation)
        if self.fuse_gemv and x2.shape[0] == 1:
            return GemvLoRA(segments, lora_shrink(x2, self.a, segments), self.b, self.part_sizes)
        main, side = torch.cuda.current_stream(x2.device), _side_stream(x2.device)
        # Allocated on the main stream (which frees it after the add that reads it last).
        delta = torch.empty(x2.shape[0], self.b.shape[1], dtype=self.b.dtype, device=x2.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            delta.zero_()
            lora_expand(delta, lora_shrink(x2, self.a, segments), self.b, segments, self.part_sizes)
        return Beside(delta)

    def apply(self, layer: LinearBase, x: torch.Tensor, started: Started) -> torch.Tensor:
        """``layer``'s output for ``x`` plus the deltas ``begin`` started."""
        if isinstance(started, GemvLoRA):
            return gemv(x.reshape(1, -1), layer.weight, layer.bias, started).view(*x.shape[:-1], -1)
        y = layer.method.apply(layer, x)
        y2 = y.view(-1, y.shape[-1])
        if isinstance(started, After):
            segments = get_lora_segments()
            lora_expand(y2, lora_shrink(started.x, self.a, segments), self.b, segments, self.part_sizes)
            return y
        torch.cuda.current_stream(y.device).wait_stream(_side_stream(y.device))
        y2.add_(started.delta)
        return y


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream LoRA deltas run on beside the base linears (one per device, made once)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream
