"""The tensor-parallel group: which rank this process is, and the collectives the layers call.

One process per rank (``engine/tp_workers.py`` starts them). Each joins a ``torch.distributed``
process group: NCCL on CUDA (its collectives are captured inside the decode CUDA graphs like any
other kernel), gloo on the CPU, so the whole tensor-parallel path also runs in CI.

A layer reads ``tp_group()`` when it is built, so the model must be built after ``init_tp`` (or
with the default, the single-rank group, whose collectives are no-ops). ``TPGroup.size == 1``
with a real process group (``force`` in ``init_tp``) still runs every collective: that is how
one GPU proves the NCCL path runs inside the CUDA graphs.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..protocol.errors import EngineConfigError
from .peer_all_reduce import FusedNormAllReduce, PeerAllReduce, check_all_reduce

logger = logging.getLogger(__name__)

# How long a collective may wait for its peers before the process group gives up (a rank that
# died mid-collective is found sooner by the workers' watchdog, engine/tp_workers.py).
COLLECTIVE_TIMEOUT_S = 600


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. ``group`` is None for a lone rank that
    never joined a process group: every collective returns its input unchanged."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    peer: object | None = None  # a PeerAllReduce for small tensors (engine/peer_all_reduce.py), or None
    # A FusedNormAllReduce ("fused"): row-parallel linears it gave slots to leave their parts
    # there, and the norm after them sums (engine/peer_all_reduce.py), or None.
    fused: object | None = None

    @property
    def active(self) -> bool:
        """Whether collectives run (a process group exists)."""
        return self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x`` itself, summed in place, or (the peer path) a
        new tensor, with ``x`` left as it was. Callers use the returned tensor."""
        if self.peer is not None and self.peer.fits(x):
            return self.peer(x)
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's ``x`` along the last dim, in rank order."""
        if self.group is None:
            return x
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        parts = torch.empty((self.size * rows.shape[0], rows.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(parts, rows, group=self.group)  # rank r's rows at [r * M, (r + 1) * M)
        gathered = parts.view(self.size, rows.shape[0], rows.shape[1]).transpose(0, 1)
        return gathered.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src`` on every rank, in place; returns it."""
        if self.group is not None:
            dist.broadcast(x, src, group=self.group)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (e.g. each rank's KV-cache budget)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


_GROUP = TPGroup()
# torch renamed all_gather_into_tensor (deprecated in newer releases; the device's 2.11 may lack the new name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_group() -> TPGroup:
    """The group of this process (the single-rank group unless ``init_tp`` ran)."""
    return _GROUP


@contextlib.contextmanager
def as_first_of(size: int) -> Iterator[None]:
    """Within the block, ``tp_group()`` is rank 0 of ``size`` ranks with no process group (no
    collective runs): building a model on the meta device in it runs every layer's split of its
    shapes, so a tp that one of them cannot take is refused before any rank starts."""
    global _GROUP
    previous, _GROUP = _GROUP, TPGroup(rank=0, size=size)
    try:
        yield
    finally:
        _GROUP = previous


def init_tp(rank: int, size: int, init_method: str, device: torch.device, all_reduce: str = "nccl") -> TPGroup:
    """Join the ``size``-rank group at ``init_method`` (``tcp://host:port``) as ``rank``; NCCL when
    ``device`` is CUDA, else gloo. Small all-reduces take the path ``all_reduce``
    (``EngineConfig.tp_all_reduce``). Called once per process, before the model is built."""
    global _GROUP
    if dist.is_initialized():
        raise EngineConfigError(
            "torch.distributed is already initialized in this process; tensor parallel needs its own "
            "process group: run the engine in a process of its own (conveyor serve api_server --tp N)")
    check_all_reduce(all_reduce, device, ranks=size)
    kind = all_reduce
    if device.type == "cuda":
        # Triton launches and CUDA graphs work on the current device, not the tensors': a rank on
        # cuda:1 whose current device is still cuda:0 fails its first kernel ("cannot be accessed").
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs)
    group = dist.group.WORLD
    # The first NCCL collective sets up the communicator: do it now, not inside a graph capture.
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    peer = PeerAllReduce(kind, group, device) if kind in ("one_shot", "two_shot") else None
    fused = FusedNormAllReduce(group, device) if kind == "fused" else None
    _GROUP = TPGroup(rank, size, group, peer, fused)
    logger.info("tensor parallel: rank %d of %d (%s, small all-reduces: %s)", rank, size, backend, kind)
    return _GROUP


def close_tp() -> None:
    """Leave the process group (the engine's shutdown); the single-rank group is back.

    Under NCCL the communicators are aborted, never destroyed: ``destroy_process_group`` is
    collective (torch >= 2.6 flushes with ``ncclCommFinalize``), and on two H200s (torch 2.11,
    NCCL 2.28) both ranks of a group that had run decode graphs waited in it forever, together;
    an abort waits for no one and frees the same resources. The ranks leave at the same time
    anyway (``LLMEngine.close``), so none is mid-collective; with a peer dead or stuck, the abort
    is what it needs too. gloo's destroy waits for no one."""
    global _GROUP
    if _GROUP.group is not None and dist.is_initialized():
        abort_tp()
        if dist.is_initialized():  # gloo (or a torch without the abort call)
            dist.destroy_process_group()
    _GROUP = TPGroup()


def forget_tp() -> None:
    """Back to the single-rank group without touching the communicators: their abort, started
    after a rank failed (``TPWorkers``), has not returned, and a second one would wait with it."""
    global _GROUP
    _GROUP = TPGroup()


def abort_tp() -> None:
    """Abort this process's NCCL communicators, so a collective waiting on a dead peer returns
    (the workers' watchdog calls it from its own thread). A no-op for gloo, whose collectives
    raise once a peer is gone, and where torch lacks the call."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized() and dist.get_backend() == "nccl":
        abort()


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) of rank ``rank``'s equal part of ``total``; refuses an uneven split."""
    if total % size:
        raise EngineConfigError(f"{what} ({total}) does not split evenly over tp={size}: pick a tp that divides it")
    part = total // size
    return rank * part, part


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first kv head, count) a rank keeps: an equal part when ``size`` divides the kv heads, one
    head replicated over ``size / num_kv_heads`` ranks when ``size`` is a multiple of them."""
    if num_kv_heads % size == 0:
        return shard_range(num_kv_heads, rank, size, "num_key_value_heads")
    if size % num_kv_heads == 0:
        return rank * num_kv_heads // size, 1
    raise EngineConfigError(f"tp={size} must divide num_key_value_heads ({num_kv_heads}) or be a multiple of it")


def check_tp_shapes(num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, size: int,
                    group_size: int | None = None) -> None:
    """Refuse, before any process starts, a model that ``size`` ranks cannot split (with
    ``group_size``, group-quantized weights: each rank's part of o_proj's and down_proj's inputs
    must be whole groups)."""
    if size == 1:
        return
    shard_range(num_heads, 0, size, "num_attention_heads")
    kv_head_range(num_kv_heads, 0, size)
    shard_range(intermediate_size, 0, size, "intermediate_size")
    for what, inputs in (("o_proj", num_heads * head_dim), ("down_proj", intermediate_size)):
        if group_size and group_size > 0 and (inputs // size) % group_size:
            raise EngineConfigError(f"{what}'s {inputs} inputs over tp={size} give {inputs // size} per rank, not "
                                    f"whole quantization groups of {group_size}: use a tp that keeps them whole")
