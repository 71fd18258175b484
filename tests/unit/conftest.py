"""Fixtures that several unit test files use (they take them by name; nothing imports them)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from calibration_models import tiny_model_dir


@pytest.fixture()
def tiny_dir(tmp_path: Path) -> Path:
    """A tiny random Llama directory for the quantization tools (``calibration_models.tiny_model_dir``)."""
    return tiny_model_dir(tmp_path)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A different, reproducible seed for every test case."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns NaN-filled floats and -128-filled int8 tensors while the test runs."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.int8:
            t.fill_(-128)
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def forced(poisoned_empty: None) -> None:
    """Kernel dispatchers run Triton whatever the device (and unsupported inputs raise); buffers
    are poisoned. The root conftest puts the default mode back after the test."""
    from conveyor.kernels._triton import set_kernel_mode

    set_kernel_mode("triton")


@pytest.fixture
def anyio_backend() -> str:
    """The async tests run on asyncio."""
    return "asyncio"


@pytest.fixture
def engine():
    """The ingress tests' deterministic fake engine client (``test_ingress.FakeEngineClient``)."""
    from test_ingress import FakeEngineClient

    return FakeEngineClient()


@pytest.fixture
def app(engine):
    """The ingress application on ``engine``."""
    from conveyor.services.ingress.app import build_app

    return build_app(engine)
