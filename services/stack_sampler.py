"""Where a stage process spends its wall time: a sampling profiler of every thread's Python stack.

Set ``CONVEYOR_STACK_SAMPLES=DIR`` in the environment of ``conveyor serve api_server`` (the
launcher's stage processes inherit it) and each stage writes ``DIR/<stage>-<pid>.folded``: one
line per distinct stack, ``thread;outermost;...;innermost <milliseconds>``, the folded format
flame-graph tools read. It is rewritten every few seconds, so a killed process still leaves one.

Each sample is weighted by the wall time since the previous one, not counted: the sampler needs
the GIL to look, so while another thread holds it inside a long C call (a CUDA sync that keeps
the GIL, a big encode) the sampler is late, and that late time lands on the stacks it sees next,
which are where the holder just came back from. A thread blocked with the GIL released (a socket
poll, a queue wait) is sampled on time and shows up at its waiting frame.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from .. import envs

logger = logging.getLogger(__name__)

ENV = "CONVEYOR_STACK_SAMPLES"  # declared in conveyor/envs.py
INTERVAL_S = 0.005
WRITE_EVERY_S = 5.0


def start_from_env(stage: str) -> "StackSampler | None":
    """Start sampling this process when ``CONVEYOR_STACK_SAMPLES`` names a directory."""
    out = envs.stack_samples_dir()
    if not out:
        return None
    try:  # here, not in the sampler's thread: a directory it cannot make is said once, in the log
        return start_in(Path(out), stage)
    except OSError as exc:
        logger.warning("%s=%s: no stack samples for %s (%s)", ENV, out, stage, exc)
        return None


def start_in(directory: Path, stage: str) -> "StackSampler":
    """Sample this process into ``directory/<stage>-<pid>.folded`` (the directory made; OSError
    when it cannot be), written every few seconds and at exit."""
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in stage)
    directory.mkdir(parents=True, exist_ok=True)
    sampler = StackSampler(directory / f"{name}-{os.getpid()}.folded")
    sampler.start()
    # The last samples at exit: a multiprocessing child runs its Finalize hooks, not atexit's.
    atexit.register(sampler.write)
    multiprocessing.util.Finalize(None, sampler.write, exitpriority=10)
    return sampler


def _frame_label(frame) -> str:
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


class StackSampler(threading.Thread):
    """Samples every other thread's stack each ``interval_s`` and keeps milliseconds per stack."""

    def __init__(self, path: Path, interval_s: float = INTERVAL_S):
        super().__init__(name="stack-sampler", daemon=True)
        self.path, self.interval_s = path, interval_s
        self.ms: Counter[str] = Counter()
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Take no more samples, and write those taken (a benchmark's timed run: the samples
        then cover that run only)."""
        self._stopped.set()
        if self.is_alive():
            self.join()
        self.write()

    def run(self) -> None:
        me = threading.get_ident()
        last = next_write = time.perf_counter()
        while not self._stopped.wait(self.interval_s):
            now = time.perf_counter()
            weight_ms, last = (now - last) * 1e3, now
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    stack.append(_frame_label(frame))
                    frame = frame.f_back
                stack.append(names.get(ident, f"thread-{ident}"))
                self.ms[";".join(reversed(stack))] += weight_ms
            if now >= next_write:
                if not self.write():
                    return
                next_write = now + WRITE_EVERY_S

    def write(self) -> bool:
        """Rewrite the samples file; False when it cannot be written (its directory removed
        under a running stage, as a test's temporary directory is): sampling then stops."""
        if not self.ms:
            return True
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(f"{stack} {ms:.0f}\n" for stack, ms in self.ms.most_common()))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("stack samples: cannot write %s (%s); sampling stops", self.path, exc)
            return False
        return True
