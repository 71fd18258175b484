"""Polling with a deadline: how a test waits for another thread or process to get somewhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str = "a condition", timeout: float = 30.0,
               every: float = 0.05, log: Callable[[], str] | None = None) -> T:
    """Call ``predicate`` every ``every`` seconds until it returns something truthy, and return that.

    After ``timeout`` seconds, AssertionError naming ``what``, with the end of ``log()`` (a server's
    log, say) when given: a CI failure is otherwise undiagnosable.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            tail = log()[-6000:] if log is not None else ""
            raise AssertionError(f"timed out waiting for {what}" + (f"; the log ends:\n{tail}" if tail else ""))
        time.sleep(every)
