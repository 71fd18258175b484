"""engine/tp_socket_dir.py: tensor parallel's socket directory is removed however rank 0 ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conveyor.engine.tp_socket_dir import PREFIX, TPSocketDir, remove_stale

_MAKE = ("import os, signal, sys; from conveyor.engine.tp_socket_dir import TPSocketDir; "
         "d = TPSocketDir(sys.argv[1]); print(d.path, flush=True); {end}")


def _owner(root: Path, end: str) -> Path:
    """The directory a separate process made before ending with ``end``."""
    done = subprocess.run([sys.executable, "-c", _MAKE.format(end=end), str(root)], capture_output=True, text=True,
                          timeout=60)
    return Path(done.stdout.strip())


def test_made_locked_and_removed(tmp_path: Path) -> None:
    import os

    d = TPSocketDir(tmp_path)
    assert d.path.is_dir() and d.path.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert remove_stale(tmp_path) == [] and d.path.is_dir()  # its owner (this process) is alive
    d.remove()
    d.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_owner_s_directory_is_removed_by_the_next_rank_0(tmp_path: Path) -> None:
    killed = _owner(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.is_dir()
    exited = _owner(tmp_path, "os._exit(1)")  # what the engine process does when a rank fails
    assert exited.is_dir() and not killed.exists()  # that process was the next rank 0
    older = tmp_path / f"{PREFIX}abc123xy"  # an older conveyor's name, no lock: not ours to judge
    older.mkdir()
    fresh = TPSocketDir(tmp_path)
    assert not exited.exists() and older.is_dir()
    fresh.remove()


def test_a_normal_interpreter_exit_removes_it(tmp_path: Path) -> None:
    left = _owner(tmp_path, "sys.exit(0)")  # no remove(): the engine was never closed
    assert left.name.startswith(PREFIX) and not left.exists()
