"""GPU SM clock, power draw and temperature sampled in a background thread while a benchmark runs.

Through the ``nvidia-smi`` command rather than pynvml, which the device machine's image may lack.
A machine without ``nvidia-smi``, or a query that fails, gives no samples: the benchmark runs on
without them.

    monitor = GpuMonitor(gpus=["0"]).start()
    ...  # the timed run
    samples = monitor.stop()
    print(summary(samples))
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from statistics import mean
from typing import NamedTuple

QUERY = "index,clocks.sm,power.draw,temperature.gpu"
QUERY_TIMEOUT_S = 5.0


class GpuSample(NamedTuple):
    """One GPU's reading; ``t`` is ``time.perf_counter()`` when the query started, a field the
    GPU does not report ("[N/A]") is None."""

    t: float
    gpu: int
    sm_mhz: float | None
    power_w: float | None
    temp_c: float | None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_line(line: str, t: float) -> GpuSample | None:
    """A sample from one line of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits``,
    or None for a line that is not one."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 4 or not fields[0].isdigit():
        return None
    sm_mhz, power_w, temp_c = (_number(f) for f in fields[1:])
    return GpuSample(t, int(fields[0]), sm_mhz, power_w, temp_c)


class GpuMonitor:
    """Samples ``gpus`` (nvidia-smi ids: indices or UUIDs; None: every GPU) every ``interval_s``
    from ``start()`` until ``stop()``, which returns the samples."""

    def __init__(self, gpus: list[str] | None = None, interval_s: float = 0.5, executable: str = "nvidia-smi"):
        self.command = [executable, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        if gpus:
            self.command.append(f"--id={','.join(gpus)}")
        self.interval_s = interval_s
        self.samples: list[GpuSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "GpuMonitor":
        if shutil.which(self.command[0]) is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> list[GpuSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(QUERY_TIMEOUT_S + 1)
        return self.samples

    def last(self) -> GpuSample | None:
        """The latest sample, for progress lines while the run goes on."""
        return self.samples[-1] if self.samples else None

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                out = subprocess.run(self.command, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=True)
            except (OSError, subprocess.SubprocessError):
                return  # a query that failed once (no driver, a bad id) fails every time: stop asking
            self.samples.extend(s for s in (parse_line(line, t) for line in out.stdout.splitlines()) if s)
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t)))


def _stats(values: list[float | None], name: str) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    return {f"{name}_{k}": (f(known) if known else None) for k, f in (("mean", mean), ("min", min), ("max", max))}


def summary(samples: list[GpuSample]) -> dict[str, dict[str, float | int | None]]:
    """Per GPU index (a string, as JSON keys are): the sample count and mean/min/max SM clock
    (MHz) and power (W), and the highest temperature (°C)."""
    per_gpu: dict[int, list[GpuSample]] = {}
    for s in samples:
        per_gpu.setdefault(s.gpu, []).append(s)
    out = {}
    for gpu, own in sorted(per_gpu.items()):
        temps = [s.temp_c for s in own if s.temp_c is not None]
        out[str(gpu)] = {"samples": len(own), **_stats([s.sm_mhz for s in own], "sm_mhz"),
                         **_stats([s.power_w for s in own], "power_w"), "temp_c_max": max(temps) if temps else None}
    return out
