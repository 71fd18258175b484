"""The directory of tensor parallel's ipc sockets (``/tmp/conveyor-tp-<pid>-XXXX``): made by rank 0,
removed however rank 0 ends.

Rank 0 removes it when it closes its ranks, when a rank fails (the engine process then leaves
through ``os._exit``, which runs no clean-up) and at interpreter exit. A process that is killed
(SIGKILL, a crash, a launcher's stop) runs none of these, so the directory carries a lock: rank 0
holds an ``flock`` on it for as long as it lives, the kernel releases the lock when the process
dies, and every new rank 0 first removes the directories whose lock nobody holds. A lock, not the
pid in the name: a pid from another container or reused by another process says nothing.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "conveyor-tp-"
# Only directories of this scheme carry the lock; older conveyors' conveyor-tp-XXXXXXXX (no pid) are left alone.
_NAME = re.compile(rf"^{re.escape(PREFIX)}\d+-[a-z0-9_]+$")


class TPSocketDir:
    """A fresh private directory, locked by this process until ``remove``; stale ones are removed first."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root or tempfile.gettempdir())
        remove_stale(self.root)
        # Made under a name no sweep looks at, locked, then renamed: a sweep never sees it unlocked.
        made = tempfile.mkdtemp(prefix=f".{PREFIX}new-", dir=self.root)
        self._fd: int | None = os.open(made, os.O_RDONLY)  # not inherited: the ranks (spawned) do not hold the lock
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path = self.root / f"{PREFIX}{os.getpid()}-{Path(made).name.rsplit('-', 1)[-1]}"
        os.rename(made, self.path)
        atexit.register(self.remove)

    def remove(self) -> None:
        """Delete the directory and release its lock (idempotent; the sockets in it may stay open)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            atexit.unregister(self.remove)


def remove_stale(root: str | Path | None = None) -> list[Path]:
    """Remove the socket directories under ``root`` whose owner is gone (nobody holds their lock);
    returns them."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if not _NAME.match(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its rank 0 is alive
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed %s, left by a tensor-parallel engine that did not end normally", path)
        finally:
            os.close(fd)
    return removed
