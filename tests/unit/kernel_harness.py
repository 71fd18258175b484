"""What the kernel test files share: error measures, the seed and poisoning fixtures, the markers
that split interpreter and GPU cases, and the run of a file's interpreter cases in a child.

A test file must set TRITON_INTERPRET (when it applies) before importing this module: importing
it imports triton, which reads that variable once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A different, reproducible seed for every test case."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns NaN-filled floats and -128-filled int8 tensors while the test runs."""
    real_empty = torch.empty

    def empty(*args, **kwargs):  # noqa: ANN002, ANN003 - torch.empty's signature
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.int8:
            t.fill_(-128)
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch, poisoned_empty: None) -> None:
    """Dispatchers run Triton whatever the device (and unsupported inputs raise)."""
    set_kernel_mode("triton")


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
