"""What the kernel test files share: error measures, the markers that split interpreter and GPU
cases, the run of a file's interpreter cases in a child, and the check of a one-row product
started early by the norm before it. Their fixtures (``seed``,
``poisoned_empty``, ``forced``) are in conftest.py.

Importing this module skips the importing test file where Triton is not installed. Whether Triton
runs interpreted is decided once per process, before anything imports it: tests/conftest.py
switches the interpreter on where there is no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor.kernels._triton import TRITON_INTERPRETED

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")  # the kernel tests compare Triton with the references

interp = pytest.mark.skipif(
    not TRITON_INTERPRETED,
    reason="Triton runs compiled in this process: test_interpreter_cases_in_child runs these",
)
gpu = pytest.mark.gpu
compiled_gpu = pytest.mark.skipif(TRITON_INTERPRETED, reason="Triton runs interpreted in this process")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere in ``out`` makes it NaN, which fails a ``<``)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype {out.dtype} != {ref.dtype}"
    assert torch.isfinite(out).all(), "non-finite output (an unwritten element?)"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol:g}"


def run_interpreter_cases_in_child(test_file: str) -> None:
    """Run ``test_file``'s interpreter cases in a child process that imports triton interpreted."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "-m", "not gpu", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout[-6000:] + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, f"interpreter cases failed in the child:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary, f"the child ran no case:\n{tail}"


_PTX_CHILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, num_warps, arch = json.loads(sys.argv[1])
kernel = getattr(__import__(module, fromlist=[name]), name)
attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
         if t.startswith("*") or t.endswith(":16")}
signature = {a: t.removesuffix(":16") for a, t in signature.items()}
src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
sys.stdout.write(triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"])
"""


def ptx_of(module: str, kernel: str, signature: dict[str, str], constexprs: dict, num_warps: int,
           arch: int = 90) -> str:
    """The PTX Triton makes of ``module.kernel`` for an NVIDIA GPU of compute capability ``arch``,
    compiled in a child process (this one may run Triton interpreted) and without a GPU: how a
    kernel's loads and stores come out, which the interpreter cannot show. ``signature`` maps each
    argument to its Triton type (``"*bf16"``, ``"i32"``, ``"constexpr"``); pointers are taken
    16-byte aligned, as a launch with torch's allocations specializes them, and an integer typed
    ``"i32:16"`` a multiple of 16, as a launch specializes such a value."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arg = json.dumps([module, kernel, signature, constexprs, num_warps, arch])
    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD, arg], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"compiling {kernel} to PTX failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def check_after_the_norm(matmul: Callable[[torch.Tensor], torch.Tensor],
                         reference: Callable[[torch.Tensor], torch.Tensor], k: int, gen: torch.Generator,
                         tol: float) -> None:
    """A one-row product right after the residual add + RMSNorm that makes its input, as in a
    decode step. On Hopper the norm lets the product launch at once (``gdc_launch_dependents``)
    and the product, launched with programmatic dependent launch, fetches weights before it
    waits for the norm: eager, then replayed five times from one CUDA graph with new inputs,
    each result must be ``reference`` of that step's normed x."""
    from conveyor.kernels.rms_norm import add_rms_norm_triton

    norm_w = (torch.rand(k, generator=gen) + 0.5).half().cuda()
    h, res = (torch.randn(1, k, generator=gen).half().cuda() for _ in range(2))

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = add_rms_norm_triton(h, res, norm_w, 1e-5)
        return x, matmul(x)

    def check(x: torch.Tensor, out: torch.Tensor) -> None:
        ref = reference(x)
        assert_close(out.to(ref.dtype), ref, tol)

    check(*step())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, out = step()
    for _ in range(5):
        h.copy_(torch.randn(1, k, generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        check(x, out)
