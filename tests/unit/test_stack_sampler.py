"""The stage processes' stack sampler (services/stack_sampler.py) and its summary
(benchmarks/stack_summary.py): a waiting thread shows up at its waiting frame, with its wall time;
a directory it cannot write is said in the log and the process goes on without samples."""

from __future__ import annotations

import logging
import threading
import time

from benchmarks.stack_summary import read_folded, summarize
from conveyor.services import stack_sampler


def _parked_here(release: threading.Event) -> None:
    release.wait()


def test_sampler_weights_stacks_by_wall_time(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(stack_sampler.ENV, str(tmp_path / "samples"))
    release = threading.Event()
    worker = threading.Thread(target=_parked_here, args=(release,), name="parked")
    worker.start()
    try:
        sampler = stack_sampler.start_from_env("engine: test")
        assert sampler is not None and sampler.path.name.startswith("engine__test-")
        time.sleep(0.5)
        sampler.write()
    finally:
        release.set()
        worker.join()
    stacks = read_folded(sampler.path)
    parked = stacks["parked"]
    assert all("_parked_here (test_stack_sampler.py" in ";".join(frames) for frames in parked)
    assert 300 <= sum(parked.values()) <= 5000  # milliseconds of wall time, not a count of samples
    # Its time is spent in the Event's wait (self), under frames it always sits in (not listed).
    lines = summarize(parked, top=5)
    assert "wait (threading.py" in lines[1] and not any("_parked_here" in line for line in lines)


def test_sampler_unset_or_unwritable(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv(stack_sampler.ENV, raising=False)
    assert stack_sampler.start_from_env("engine") is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(stack_sampler.ENV, str(blocker / "samples"))
    with caplog.at_level(logging.WARNING):
        assert stack_sampler.start_from_env("engine") is None
    assert "no stack samples for engine" in caplog.text and stack_sampler.ENV in caplog.text


def test_sampler_stops_when_its_directory_is_removed(tmp_path, caplog) -> None:
    """A stage whose samples directory disappears (a test's temporary one) stops sampling with a
    warning instead of dying with a traceback in its thread."""
    sampler = stack_sampler.StackSampler(tmp_path / "gone" / "engine.folded", interval_s=0.01)
    sampler.ms["main;f"] = 5.0
    with caplog.at_level(logging.WARNING):
        assert sampler.write() is False
    assert "sampling stops" in caplog.text
