"""What the kernel test files share: error measures, the markers that split interpreter and GPU
cases, and the run of a file's interpreter cases in a child. Their fixtures (``seed``,
``poisoned_empty``, ``forced``) are in conftest.py.

Importing this module skips the importing test file where Triton is not installed. Whether Triton
runs interpreted is decided once per process, before anything imports it: tests/conftest.py
switches the interpreter on where there is no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
