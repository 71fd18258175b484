"""pyproject.toml lists every package of the source tree: a folder with an ``__init__.py`` that
``[tool.setuptools] packages`` misses installs from a wheel without it (kernels/moe once did:
only the editable installs of development and the device machine had it)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_package_is_listed() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / path for name, path in setup["package-dir"].items()}
    found = set()
    for top, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join((top, *rel.parts)))
    assert found - set(setup["packages"]) == set()


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """The source folder of ``package``: its longest listed prefix's folder plus the rest."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return ROOT.joinpath(package_dir[prefix], *parts[n:])
    raise AssertionError(f"{package} is under no package-dir entry")


def test_package_data_globs_match_files() -> None:
    """Each package-data glob names at least one file (a moved data file would be dropped)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, globs in setup["package-data"].items():
        folder = _folder(package, setup["package-dir"])
        for pattern in globs:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches nothing under {folder}"
