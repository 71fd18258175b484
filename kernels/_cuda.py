"""CUDA C++ kernels compiled at run time: NVRTC through cupy's ``RawModule``, launched on torch's
current stream (so CUDA graphs capture them like any torch kernel).

For what Triton cannot express (register layouts of tensor-core fragments): the user's machine
needs no compiler, only the cupy wheel of its CUDA version; cupy keeps compiled modules in its
on-disk cache. Without cupy, or on a GPU older than sm_80 (``mma.sync.m16n8k16``, ``cp.async``),
``cuda_kernels_available`` is False and callers keep their Triton or torch path, as they do when
the process's kernel mode (``_triton.set_kernel_mode``) is ``triton`` or ``ref``.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._triton import kernel_mode

try:
    import cupy

    HAS_CUPY = True
except Exception:  # noqa: BLE001 - not installed, or no CUDA driver for it: the kernels stay off
    cupy = None
    HAS_CUPY = False

MIN_CAPABILITY = (8, 0)
logger = logging.getLogger(__name__)


def device_index(device: torch.device) -> int:
    """A CUDA device's index (``cuda`` alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def cuda_kernels_available(device: torch.device) -> bool:
    """Whether this process runs CUDA C++ kernels on ``device``: cupy imports, the device is a
    CUDA GPU of sm_80 or later, and the kernel mode is ``auto``."""
    return HAS_CUPY and device.type == "cuda" and kernel_mode() == "auto" and _device_ok(device_index(device))


@functools.cache
def _module(source: Path, names: tuple[str, ...], index: int) -> Any:
    with cupy.cuda.Device(index):
        module = cupy.RawModule(code=source.read_text(), options=("-std=c++17",), name_expressions=names)
        module.compile()
        return module


@functools.cache
def compiles(source: Path, names: tuple[str, ...], index: int) -> bool:
    """Whether the module builds on this device (once per process): a cupy whose NVRTC or CUDA
    headers do not match the driver fails here, and its callers keep their Triton path, with the
    reason logged once, instead of failing at their first launch."""
    try:
        _module(source, names, index)
        return True
    except Exception as exc:  # noqa: BLE001 - NVRTC / driver errors of every kind: fall back
        logger.warning("CUDA kernels of %s not used on cuda:%d (%s: %s); the Triton kernels run instead",
                       source.name, index, type(exc).__name__, exc)
        return False


@functools.cache
def kernel(source: Path, name: str, names: tuple[str, ...], index: int, shared_bytes: int = 0) -> Any:
    """The compiled function ``name`` (a template instance such as ``f<1, 2>``) of the CUDA file
    ``source``; ``names`` lists every instance the module is built with (one compilation for all).
    ``shared_bytes`` above the default 48 KiB of dynamic shared memory is allowed up front."""
    with cupy.cuda.Device(index):
        fn = _module(source, names, index).get_function(name)
        if shared_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        return fn


@functools.cache
def _external_stream(index: int, handle: int) -> Any:
    # cupy 14 deprecates ExternalStream for Stream.from_external(obj with __cuda_stream__), which
    # older cupy (and a torch stream without that protocol) lack; the handle works on both.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, index)


def launch(fn: Any, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
           shared_bytes: int = 0) -> None:
    """Launch ``fn`` on ``device``'s current torch stream. ``args``: tensors (passed as their data
    pointers), Python ints (as C ``int``) and None (a null pointer)."""
    index = device_index(device)
    c_args = tuple(_c_arg(a) for a in args)
    stream = _external_stream(index, torch.cuda.current_stream(device).cuda_stream)
    with cupy.cuda.Device(index), stream:
        fn(grid, block, c_args, shared_mem=shared_bytes)


def _c_arg(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return np.uint64(a.data_ptr())
    if a is None:
        return np.uint64(0)
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"CUDA kernel arguments are tensors, ints or None, got {type(a).__name__}")
    return np.int32(a)
