"""Fixtures of the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from calibration_models import tiny_model_dir


@pytest.fixture()
def tiny_dir(tmp_path: Path) -> Path:
    """A tiny random Llama directory for the quantization tools (``calibration_models.tiny_model_dir``)."""
    return tiny_model_dir(tmp_path)
