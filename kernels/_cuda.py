"""CUDA C++ kernels compiled at run time: NVRTC through cupy's ``RawModule``, launched on torch's
current stream (so CUDA graphs capture them like any torch kernel).

For what Triton cannot express (register layouts of tensor-core fragments): the user's machine
needs no compiler, only the cupy wheel of its CUDA version; cupy keeps compiled modules in its
on-disk cache. Without cupy, or on a GPU older than sm_80 (``mma.sync.m16n8k16``, ``cp.async``),
``cuda_kernels_available`` is False and callers keep their Triton or torch path, as they do when
the process's kernel mode (``_triton.set_kernel_mode``) is ``triton`` or ``ref``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._triton import hopper_or_later, kernel_mode

try:
    import cupy

    HAS_CUPY = True
except Exception:  # noqa: BLE001 - not installed, or no CUDA driver for it: the kernels stay off
    cupy = None
    HAS_CUPY = False

try:  # the driver API's cuLaunchKernelEx, for launch attributes cupy's kernels do not take
    from cuda.bindings import driver as cu_driver
except Exception:  # noqa: BLE001 - cuda-python not installed: launches without attributes
    cu_driver = None

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
def _module(source: Path, names: tuple[str, ...], index: int, options: tuple[str, ...] = ()) -> Any:
    with cupy.cuda.Device(index):
        try:
            module = cupy.RawModule(code=source.read_text(), options=("-std=c++17", *options),
                                    name_expressions=names)
            module.compile()
            return module
        except Exception:
            if not options:
                raise
            # cupy adds its own -arch=compute_XX, which an arch-specific target (sm_90a) may not
            # survive: build the cubin with NVRTC through cuda-python instead.
            return _nvrtc_module(source, names, options)


class _LoweredModule:
    """A module loaded from a cubin, its functions looked up by their template names."""

    def __init__(self, module: Any, lowered: dict[str, str]) -> None:
        self.module, self.lowered = module, lowered

    def get_function(self, name: str) -> Any:
        return self.module.get_function(self.lowered[name])


def _nvrtc_module(source: Path, names: tuple[str, ...], options: tuple[str, ...]) -> _LoweredModule:
    from cuda.bindings import nvrtc

    def check(result: Any, what: str) -> None:
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC {what} of {source.name}: {result}")

    err, prog = nvrtc.nvrtcCreateProgram(source.read_text().encode(), source.name.encode(), 0, [], [])
    check(err, "create")
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(prog, name.encode())[0], f"name {name}")
        # -default-device: lambdas in kernels (nvcc and cupy's route take them as device code)
        opts = [b"-std=c++17", b"-default-device", *(o.encode() for o in options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not build {source.name} {options}: {log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        check(err, "cubin size")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "cubin")
        lowered = {}
        for name in names:
            err, low = nvrtc.nvrtcGetLoweredName(prog, name.encode())
            check(err, f"lowered name of {name}")
            lowered[name] = low.decode() if isinstance(low, bytes) else low
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    return _LoweredModule(module, lowered)


@functools.cache
def compiles(source: Path, names: tuple[str, ...], index: int, options: tuple[str, ...] = ()) -> bool:
    """Whether the module builds on this device (once per process): a cupy whose NVRTC or CUDA
    headers do not match the driver fails here, and its callers keep their Triton path, with the
    reason logged once, instead of failing at their first launch."""
    try:
        _module(source, names, index, options)
        return True
    except Exception as exc:  # noqa: BLE001 - NVRTC / driver errors of every kind: fall back
        logger.warning("CUDA kernels of %s not used on cuda:%d (%s: %s); the Triton kernels run instead",
                       source.name, index, type(exc).__name__, exc)
        return False


@functools.cache
def kernel(source: Path, name: str, names: tuple[str, ...], index: int, shared_bytes: int = 0,
           options: tuple[str, ...] = ()) -> Any:
    """The compiled function ``name`` (a template instance such as ``f<1, 2>``) of the CUDA file
    ``source``; ``names`` lists every instance the module is built with (one compilation for all),
    ``options`` NVRTC's beyond the language standard (an arch-specific target). ``shared_bytes``
    above the default 48 KiB of dynamic shared memory is allowed up front."""
    with cupy.cuda.Device(index):
        fn = _module(source, names, index, options).get_function(name)
        if shared_bytes > 48 * 1024:
            if hasattr(fn, "max_dynamic_shared_size_bytes"):  # a RawKernel
                fn.max_dynamic_shared_size_bytes = shared_bytes
            else:  # a Function of a module loaded from a cubin (_nvrtc_module)
                cupy.cuda.driver.funcSetAttribute(
                    fn.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
        return fn


@functools.cache
def _external_stream(index: int, handle: int) -> Any:
    # cupy 14 deprecates ExternalStream for Stream.from_external(obj with __cuda_stream__), which
    # older cupy (and a torch stream without that protocol) lack; the handle works on both.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, index)


def launch(fn: Any, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
           shared_bytes: int = 0, pdl: bool = False) -> None:
    """Launch ``fn`` on ``device``'s current torch stream. ``args``: tensors (passed as their data
    pointers), Python ints (as C ``int``) and None (a null pointer).

    ``pdl``: programmatic dependent launch where the GPU (sm_90) and cuda-python allow it: the
    kernel may start while the one before it on the stream still runs, and must itself wait
    (``griddepcontrol.wait``) before reading what that kernel writes."""
    index = device_index(device)
    values = tuple(_arg(a) for a in args)
    handle = torch.cuda.current_stream(device).cuda_stream
    with cupy.cuda.Device(index):
        if pdl and _pdl_ok(index):
            _launch_pdl(fn, grid, block, values, shared_bytes, handle)
            return
        c_args = tuple(np.uint64(v) if ptr else np.int32(v) for v, ptr in values)
        with _external_stream(index, handle):
            fn(grid, block, c_args, shared_mem=shared_bytes)


@functools.cache
def _pdl_ok(index: int) -> bool:
    return cu_driver is not None and hopper_or_later(index)


def _launch_pdl(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], values: tuple[tuple[int, bool], ...],
                shared_bytes: int, stream: int) -> None:
    cfg = cu_driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (*grid, 1, 1)[:3]
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (*block, 1, 1)[:3]
    cfg.sharedMemBytes = shared_bytes
    cfg.hStream = cu_driver.CUstream(stream)
    attr = cu_driver.CUlaunchAttribute()
    attr.id = cu_driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    params = (tuple(v for v, _ in values), tuple(ctypes.c_void_p if ptr else ctypes.c_int for _, ptr in values))
    # a RawKernel (cupy's NVRTC route) holds its CUfunction in .kernel; a Function (a module
    # loaded from a cubin) is one
    handle = getattr(fn, "kernel", fn).ptr
    (err,) = cu_driver.cuLaunchKernelEx(cfg, cu_driver.CUfunction(handle), params, 0)
    if err != cu_driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx failed: {err}")


def _arg(a: Any) -> tuple[int, bool]:
    """A kernel argument as (value, is a pointer)."""
    if isinstance(a, torch.Tensor):
        return a.data_ptr(), True
    if a is None:
        return 0, True
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"CUDA kernel arguments are tensors, ints or None, got {type(a).__name__}")
    return a, False
