"""conveyor/envs.py is the one place the environment is read: every variable declared with its
default and meaning, and no other product file reading ``os.environ`` for behaviour."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor import envs

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("conveyor", "engine", "kernels", "protocol", "services")
ENVS = ROOT / "conveyor" / "envs.py"
# A line that copies or extends the environment for a child process says so with this marker.
CHILD_ENV = "# env: for a child process"


def _product_files():
    for folder in PRODUCT:
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if p != ENVS)


def _environment_reads(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line`` of each read of the environment in ``path``: ``os.environ.get``/``[...]``,
    ``getenv``, ``environ`` in a condition; writes (assignment, ``setdefault``, ``pop``,
    ``update``) and lines marked ``CHILD_ENV`` are not reads."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", None)
        if line is None or CHILD_ENV in lines[line - 1]:
            continue
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            found.append(f"{path.relative_to(root)}:{line}")
        elif isinstance(node, ast.Attribute) and node.attr in ("get", "__getitem__", "copy", "items", "keys"):
            if isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
                found.append(f"{path.relative_to(root)}:{line}")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
                found.append(f"{path.relative_to(root)}:{line}")
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Attribute) and c.attr == "environ" for c in node.comparators):
            found.append(f"{path.relative_to(root)}:{line}")  # "NAME in os.environ"
    return found


def test_only_envs_py_reads_the_environment() -> None:
    reads = [r for path in _product_files() for r in _environment_reads(path)]
    assert not reads, ("read the variable through conveyor/envs.py (declare it there), or mark a line that builds "
                       f"a child's environment with {CHILD_ENV!r}: {reads}")


def test_the_scan_finds_a_read(tmp_path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nA = os.environ.get('X')\nB = os.environ['Y']\nC = os.getenv('Z')\n"
                      "D = 'W' in os.environ\nos.environ['V'] = '1'\nos.environ.setdefault('U', '1')\n"
                      f"E = {{**os.environ}}  {CHILD_ENV}\n")
    assert sorted(int(r.split(":")[1]) for r in _environment_reads(sample, tmp_path)) == [2, 3, 4, 5]


def test_every_variable_has_a_meaning() -> None:
    for name, (default, doc) in envs.VARIABLES.items():
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", name), name
        assert default is None or isinstance(default, str), name
        assert isinstance(doc, str) and len(doc.split()) >= 4, f"{name}: say what it does, in a sentence"


def test_every_conveyor_variable_named_in_the_product_is_declared() -> None:
    """A name in a docstring or message that is not declared is a variable that no longer exists
    (or one read around this module)."""
    undeclared = {}
    for path in _product_files():
        for name in re.findall(r"\bCONVEYOR_[A-Z][A-Z0-9_]*\b", path.read_text()):
            if name not in envs.VARIABLES:
                undeclared.setdefault(name, str(path.relative_to(ROOT)))
    assert not undeclared, undeclared


def test_an_undeclared_name_is_refused() -> None:
    with pytest.raises(KeyError):
        envs.get("CONVEYOR_NOT_DECLARED")


def test_accessors_read_at_call_time(monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_ENGINE_HOST", raising=False)
    monkeypatch.delenv("CONVEYOR_BIND_HOST", raising=False)
    assert envs.stage_host("engine") == "engine" and envs.bind_host() is None
    monkeypatch.setenv("CONVEYOR_ENGINE_HOST", "10.0.0.2")
    monkeypatch.setenv("CONVEYOR_BIND_HOST", "10.0.0.3")
    assert envs.stage_host("engine") == "10.0.0.2" and envs.bind_host() == "10.0.0.3"
    monkeypatch.setenv("CONVEYOR_API_KEYS", " sk-1, ,sk-2 ")
    assert envs.key_list("CONVEYOR_API_KEYS") == ["sk-1", "sk-2"]
    monkeypatch.setenv("TRITON_INTERPRET", "True")
    assert envs.flag("TRITON_INTERPRET")
    monkeypatch.setenv("CONVEYOR_FAKE_STEP_DELAY", "0.25")
    assert envs.fake_step_delay() == 0.25


def test_envs_imports_nothing_but_os() -> None:
    """Every folder imports it (protocol/ and the stateless stages without torch)."""
    tree = ast.parse(ENVS.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"os", "__future__"}
    code = "import sys, conveyor.envs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
