"""Optional Triton support shared by the kernel files: guarded import, dispatch policy, small helpers.

Dispatch policy: one mode for the whole process, ``auto`` until ``set_kernel_mode`` changes it
(the engine calls it once at start with ``EngineConfig.kernels``; tests call it to force a side):

* ``auto``: Triton when it imports and the tensors are on CUDA, else the torch reference;
* ``ref``: the torch reference everywhere;
* ``triton``: Triton everywhere. CPU tensors then need Triton's interpreter, which Triton only
  enables for a whole process: ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
  imported (Triton's own library functions such as ``tl.sum`` are decorated at that import, so the
  mode cannot be switched later). Shapes the kernels do not support raise instead of silently
  falling back, so a forced run really exercises Triton.
"""

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install: either way, no Triton
    triton = None
    # Kernel signatures annotate ``tl.constexpr`` at definition time; give them something to name.
    tl = types.SimpleNamespace(constexpr=Any)
    HAS_TRITON = False


def _interpreted() -> bool:
    """Whether this process's Triton was imported in interpreter mode (see the module doc)."""
    if not HAS_TRITON:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction

        # A library function decorated when triton.language was imported tells the mode it got.
        return isinstance(tl.zeros, InterpretedFunction)
    except Exception:  # noqa: BLE001 - internal layout changed: fall back to the variable
        # Imported here: from the repository's root, transformers' probe for a "kernels" package
        # imports this folder as a top-level package, which has no parent to import from.
        from .. import envs

        return envs.flag("TRITON_INTERPRET")


TRITON_INTERPRETED = _interpreted()

try:  # grid dependency control (Hopper's programmatic dependent launch), Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # noqa: BLE001 - an older Triton, or none
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def hopper_or_later(index: int) -> bool:
    """Whether CUDA device ``index`` is an NVIDIA GPU of sm_90 or later (ROCm reports its gfx
    version as the capability): where programmatic dependent launch exists."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_trigger(t: torch.Tensor) -> bool:
    """Whether a kernel working on ``t`` should call ``gdc_launch_dependents`` first (its
    ``PDL_TRIGGER``): on Hopper or later, compiled (not interpreted), with a Triton that has it.
    The call lets a kernel launched after it with programmatic dependent launch (the one-row
    GEMVs: the tensor-core W4A16 one, ``_cuda.launch(pdl=True)``, and the fp16 one,
    ``gemv.gemv_triton``) start and request its weights while this one runs;
    that kernel waits (``griddepcontrol.wait``) for this one's writes before it reads them. With
    any other successor the call changes nothing."""
    return (gdc_launch_dependents is not None and not TRITON_INTERPRETED and t.is_cuda
            and hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def _patch_interpreter_scalar_index() -> None:
    """Let interpreted kernels loop over ``range(tensor_start, tensor_end)`` with NumPy >= 2.5.

    The interpreter holds a scalar as a one-element 1-D array, and Triton <= 3.6 converts it with
    ``int(array)``, which NumPy 2.5 turned from a deprecation into an error (Triton 3.7+ squeezes
    first). Only the interpreter, a test/debug mode, is touched; compiled kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no interpreter module: nothing to fix
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_conveyor_scalar_index", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._conveyor_scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if TRITON_INTERPRETED:
    _patch_interpreter_scalar_index()


def jit(fn: _F) -> _F:
    """``triton.jit`` when Triton imports; otherwise the plain function (never launched then)."""
    return triton.jit(fn) if HAS_TRITON else fn


@jit
def row_and_cols(BLOCK: tl.constexpr):
    """For a grid ``(rows, cdiv(columns, BLOCK))``: this program's row (int64, for addresses) and
    its ``BLOCK`` column indices."""
    return tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)


@jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s output tile ``(pid_m, pid_n)`` of an [M, N] matmul, taken in bands of
    GROUP_M tile rows that walk one tile column at a time: programs running together share weight
    tiles (and their activation rows) in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    band = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % band) % band_m, (pid % band) // band_m


@functools.cache
def sm_count(device: torch.device, interpreted: int = 1) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``interpreted`` elsewhere (how many a
    launcher should plan for under the interpreter: few programs keep CPU tests quick)."""
    if device.type != "cuda":
        return interpreted
    return torch.cuda.get_device_properties(device).multi_processor_count


KERNEL_MODES = ("auto", "ref", "triton")  # EngineConfig.kernels accepts these (engine/config.py)
_mode = "auto"  # this process's dispatch mode: set_kernel_mode, never read from the environment


def set_kernel_mode(mode: str) -> None:
    """Make every dispatcher of this process follow ``mode`` (see the module doc)."""
    global _mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r}: use one of {', '.join(KERNEL_MODES)}")
    _mode = mode


def kernel_mode() -> str:
    """The dispatch mode this process runs: ``auto`` (default), ``ref`` or ``triton``."""
    return _mode


def triton_takes(
    name: str, tensors: tuple[torch.Tensor, ...], problem: Callable[..., str | None], *args: Any
) -> bool:
    """Whether the dispatcher ``name`` runs its Triton kernel on ``tensors`` (see the module doc).

    ``problem(*args)`` says why the kernel cannot take these inputs, or None when it can; it runs
    only where Triton would. Inputs it cannot take go to the reference, except under
    the ``triton`` mode, where they raise.
    """
    mode = _mode
    if mode == "ref":
        return False
    if mode == "auto":
        if not (HAS_TRITON and all(t.is_cuda for t in tensors)):
            return False
    else:
        if not HAS_TRITON:
            raise RuntimeError("kernels='triton' but triton cannot be imported")
        if not TRITON_INTERPRETED and not all(t.is_cuda for t in tensors):
            raise RuntimeError(
                "kernels='triton' on CPU tensors needs Triton's interpreter: "
                "set TRITON_INTERPRET=1 before triton is first imported"
            )
    why = problem(*args)
    if why is None:
        return True
    if mode == "triton":
        raise ValueError(f"{name} Triton kernel does not support these inputs: {why}")
    return False


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
