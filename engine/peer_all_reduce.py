"""All-reduce of decode-sized tensors by direct reads of the peers' GPU memory (NVLink).

Why: at batch 1 a Llama-2-7B decode step at tp=2 runs ~67 collectives. On two H200s a step took
3.24 ms against at most ~2.1 ms for tp=1's step halved (docs/benchmarks.md, session 13), so a
collective costs at most ~16 µs inside the CUDA graph (an estimate from step times, which also
hold per-kernel costs that do not halve; ``python -m benchmarks.bench_tp_comm`` measures both
paths). torch's symmetric-memory kernels do the sum in
one launch with an in-kernel barrier: every rank's buffer is mapped into every other rank's
address space.

* ``one_shot``: each rank reads every peer's whole buffer and sums (lowest latency; each byte
  crosses the link ``world - 1`` times, fine at a few hundred KiB).
* ``two_shot``: reduce-scatter then all-gather through the same buffers (less traffic, two
  barriers); in place.

Chosen with ``EngineConfig.tp_all_reduce`` (``nccl``, the default, ``one_shot`` or ``two_shot``).
Only tensors up to ``PEER_ALLREDUCE_MAX_BYTES`` take this path; larger ones (prefill) stay on
NCCL, whose bandwidth wins there. The input is copied into the registered buffer (a small copy,
captured in the decode graphs with the rest); ``one_shot``'s sum comes back as a new tensor,
which the caller uses without a copy back; ``two_shot``'s is copied back into the input.

NVLink multicast (``multimem_*`` kernels) is never used: the device notes forbid it.
"""

from __future__ import annotations

import math

import torch

from ..protocol.errors import EngineConfigError
from .config import TP_ALL_REDUCE_KINDS

PEER_ALLREDUCE_MAX_BYTES = 1 << 20  # [128, 4096] bf16: every decode batch up to 128 of a 7B model
# What torch's symmetric-memory all-reduce kernels are built for: no float16 (on the H200, torch
# 2.11 answers '"one_shot_all_reduce" not implemented for 'Half'').
_DTYPES = (torch.bfloat16, torch.float32)
# Whether this process has mapped peer buffers through torch's symmetric memory (one_shot,
# two_shot, fused) for some process group: it cannot for another (``check_all_reduce``).
_SYMMETRIC_MEMORY_SET_UP = False


def check_all_reduce(kind: str, device: torch.device, tensor_parallel: bool = True,
                     dtype: torch.dtype | None = None, ranks: int = 2) -> None:
    """Refuse the all-reduce path ``kind`` (``EngineConfig.tp_all_reduce``) for a rank on
    ``device`` whose activations are ``dtype`` in a group of ``ranks`` processes when it cannot
    run there: an unknown one, a peer path off the GPU or for a dtype its kernels lack, a peer
    path for an engine that runs no all-reduce (``tensor_parallel`` False: tp=1 without a process
    group), and a peer path across processes after this process set one up for another group."""
    if kind not in TP_ALL_REDUCE_KINDS:
        raise EngineConfigError(f"tp_all_reduce={kind!r} is not one of {', '.join(TP_ALL_REDUCE_KINDS)}")
    if kind == "nccl":
        return
    if not tensor_parallel:
        raise EngineConfigError(f"tp_all_reduce={kind!r} picks tensor parallel's all-reduce, and this engine runs "
                                "tp=1 with none: use tp_all_reduce='nccl', or split the model with tp=N")
    if device.type != "cuda":
        raise EngineConfigError(f"tp_all_reduce={kind!r} reads peer GPUs' memory: it needs CUDA devices (the "
                                f"engine is on {device}); use tp_all_reduce='nccl' (the process group's all-reduce)")
    if _SYMMETRIC_MEMORY_SET_UP and ranks > 1:
        # torch numbers a rendezvous's store keys with a count kept per process: this process
        # would wait on keys the new rank processes (counting from zero) never write (two H200s,
        # torch 2.11: a second fused engine in one process waited forever). A group of this
        # process alone (tp=1 with a process group) reads the keys it writes.
        raise EngineConfigError(
            f"tp_all_reduce={kind!r} maps peer buffers through torch's symmetric memory, which an earlier engine "
            "in this process already set up, and cannot be set up again in the same process: start this engine in "
            "a fresh process (conveyor serve does: a restarted engine stage is a new process), or use "
            "tp_all_reduce='nccl'")
    if kind != "fused" and dtype is not None and dtype not in _DTYPES:
        raise EngineConfigError(f"tp_all_reduce={kind!r} runs torch's symmetric-memory kernels, which have no {dtype}: "
                                "load the model with dtype='bfloat16' (--dtype bfloat16), or use tp_all_reduce='nccl'")


class PeerAllReduce:
    """Sums small tensors over the group through one registered (symmetric-memory) buffer."""

    def __init__(self, kind: str, group, device: torch.device, max_bytes: int = PEER_ALLREDUCE_MAX_BYTES):
        if kind not in ("one_shot", "two_shot"):
            raise EngineConfigError(f"no peer all-reduce called {kind!r}: pick one_shot or two_shot")
        self.kind = kind
        self.name = group.group_name
        self.buffer, _ = symmetric_buffer(max_bytes, group, device)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes this way (else the process group's all-reduce takes it)."""
        return x.dtype in _DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: a new tensor (``one_shot``, ``x`` left as it was), or
        ``x`` summed in place (``two_shot``: the sum lands in the shared buffer, which the next
        all-reduce overwrites while the residual stream may still hold it, so it is copied out)."""
        buf = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        buf.copy_(x.view(-1))
        if self.kind == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.name).view_as(x)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.name)
        return x.copy_(buf.view_as(x))


# ---- the all-reduce fused with the residual add and RMSNorm after it ("fused") ----------------------

FUSED_SLOT_BYTES = 2 << 20  # [256, 4096] or [128, 8192] of 16-bit rows: every decode graph of a 70B model
# Steps of more rows (prefill chunks) take NCCL and the separate norm. On two H200s in a CUDA
# graph (bench_tp_comm, record h200x2/issue36_s30_bench_tp_comm_w2.json) the fused tail took
# 7.4 / 7.7 / 9.2 / 11.6 / 16.1 µs at 1 / 8 / 64 / 128 / 256 rows against NCCL + add_rms_norm's
# 8.7 / 9.3 / 12.4 / 16.5 / 29.7 µs, since its peer reads are 16-byte loads (before them it lost
# past 8 rows: 20.8 against 12.4 µs at 64). 256 rows fill the slot at a hidden size of 4096.
# (It is also the rows of flags, and a grid's programs, one a row, must all be resident at once.)
FUSED_MAX_ROWS = 256
_FUSED_SLOTS = 4  # a ring long enough that consecutive sums never share a slot (FusedNormAllReduce.assign)


class PartialSum:
    """A row-parallel linear's output, this rank's part only, already in its slot of the shared
    buffer: the norm after it sums the ranks' parts, adds the residual and normalizes in one
    kernel (``FusedNormAllReduce.add_rms_norm``). Anything else that reads it calls ``total``."""

    __slots__ = ("part", "reducer", "slot")

    def __init__(self, reducer: "FusedNormAllReduce", slot: int, part: torch.Tensor) -> None:
        self.reducer, self.slot, self.part = reducer, slot, part

    def total(self) -> torch.Tensor:
        """The sum over the ranks as a plain tensor (the process group's all-reduce of the part)."""
        import torch.distributed as dist

        out = self.part.clone()
        dist.all_reduce(out, group=self.reducer.group)
        return out


class FusedNormAllReduce:
    """One symmetric-memory buffer per rank: int32 flags, then a ring of slots for the ranks'
    partial sums; the kernel is ``kernels/peer_norm.py``. Built by ``init_tp`` (collective: every
    rank maps every rank's buffer); ``assign`` gives the model's row-parallel linears their slots."""

    def __init__(self, group, device: torch.device, slot_bytes: int = FUSED_SLOT_BYTES,
                 max_rows: int = FUSED_MAX_ROWS) -> None:
        import torch.distributed as dist

        self.group, self.device = group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.slot_bytes, self.max_rows = slot_bytes, max_rows
        flag_bytes = -(-max_rows * self.world * 4 // 256) * 256
        self.buffer, handle = symmetric_buffer(flag_bytes + _FUSED_SLOTS * slot_bytes, group, device)
        bases = [_peer_address(handle, r, self.buffer) for r in range(self.world)]
        # The kernel reads a slot's rows as 16-byte vectors (kernels/peer_norm.py says so to Triton).
        if any((b + flag_bytes) % 16 for b in bases) or slot_bytes % 16:
            raise RuntimeError(f"fused all-reduce: slots must start on 16-byte boundaries (buffers at "
                               f"{[hex(b) for b in bases]}, {flag_bytes} bytes of flags, slots of {slot_bytes})")
        # Flags start at 0 on every rank before any rank can signal: zeroed, then a barrier.
        self.buffer[:flag_bytes].zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        self.flag_ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        self.slot_ptrs = torch.tensor([[b + flag_bytes + s * slot_bytes for b in bases] for s in range(_FUSED_SLOTS)],
                                      dtype=torch.int64, device=device)
        self._slots = [self.buffer[flag_bytes + s * slot_bytes: flag_bytes + (s + 1) * slot_bytes]
                       for s in range(_FUSED_SLOTS)]

    def assign(self, linears: list) -> bool:
        """Give each of ``linears`` (row-parallel, in the order a forward runs them) a slot:
        site i takes slot i mod k, with k the smallest ring for which the last site and the first
        (consecutive across two forwards) differ too. False, and nothing assigned, when no ring
        fits (``_FUSED_SLOTS`` slots) or there are fewer than two sites."""
        n = len(linears)
        ring = next((k for k in range(2, _FUSED_SLOTS + 1) if (n - 1) % k), None) if n >= 2 else None
        if ring is None:
            return False
        for i, linear in enumerate(linears):
            linear.reduce_slot = i % ring
        return True

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (rows of the hidden size) goes through a slot."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        return self._fits(rows, x.numel() * x.element_size(), x.dtype, x.device)

    def _fits(self, rows: int, nbytes: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (dtype in (torch.float16, torch.bfloat16, torch.float32) and device == self.device
                and 0 < rows <= self.max_rows and nbytes <= self.slot_bytes)

    def slot_view(self, slot: int, rows: int, cols: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
        """Slot ``slot`` as a ``[rows, cols]`` tensor to write this rank's part into (the
        row-parallel linear's product, no copy after it), or None when that part does not fit."""
        if not self._fits(rows, rows * cols * dtype.itemsize, dtype, device):
            return None
        return self._view(slot, (rows, cols), dtype)

    def partial(self, slot: int, part: torch.Tensor) -> PartialSum:
        """The ``PartialSum`` of a part already written into slot ``slot`` (``slot_view``)."""
        return PartialSum(self, slot, part)

    def stage(self, slot: int, part: torch.Tensor) -> PartialSum:
        """Copy this rank's ``part`` into its slot ``slot``."""
        self._view(slot, part.shape, part.dtype).copy_(part)
        return PartialSum(self, slot, part)

    def _view(self, slot: int, shape, dtype: torch.dtype) -> torch.Tensor:
        return self._slots[slot][:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def add_rms_norm(self, partial: PartialSum, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(sum over the ranks of the part, residual)`` in one kernel."""
        from ..kernels.peer_norm import peer_add_rms_norm_triton

        part = partial.part
        rows = part.numel() // part.shape[-1]
        residual = residual if residual.dtype == part.dtype else residual.to(part.dtype)
        return peer_add_rms_norm_triton(self.slot_ptrs[partial.slot], self.flag_ptrs, self.rank, rows,
                                        residual.contiguous(), weight.to(part.dtype).contiguous(), eps)


def symmetric_buffer(nbytes: int, group, device: torch.device):
    """A buffer of ``nbytes`` on ``device`` that every rank of ``group`` maps (torch symmetric
    memory; collective), and its handle (the peers' addresses). One process sets this up for one
    group only: ``check_all_reduce`` refuses a later group, which would hang (see there)."""
    global _SYMMETRIC_MEMORY_SET_UP
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed before rendezvous in torch < 2.8, harmless after
        enable(name)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group=name)
    _SYMMETRIC_MEMORY_SET_UP = True
    return buffer, handle


def _peer_address(handle, rank: int, local: torch.Tensor) -> int:
    """Rank ``rank``'s buffer as an address in this process."""
    ptrs = getattr(handle, "buffer_ptrs", None)
    if ptrs is not None:
        return int(ptrs[rank])
    return handle.get_buffer(rank, (local.numel(),), torch.uint8).data_ptr()
