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


def test_a_stopped_sampler_takes_no_more_samples_and_has_written_them(tmp_path, capsys) -> None:
    """``stop`` (a benchmark's timed run, profile_throughput --stack-samples) ends the sampling
    thread and writes what it took; profile_throughput prints the main thread's frames from it."""
    from benchmarks.profile_throughput import print_main_thread_stacks

    sampler = stack_sampler.StackSampler(tmp_path / "engine-1.folded", interval_s=0.005)
    sampler.start()
    time.sleep(0.2)
    sampler.stop()
    assert not sampler.is_alive()
    taken = dict(sampler.ms)
    time.sleep(0.05)
    assert dict(sampler.ms) == taken and taken
    stacks = read_folded(sampler.path)
    assert "MainThread" in stacks and 100 <= sum(stacks["MainThread"].values()) <= 2000
    print_main_thread_stacks(sampler.path)
    out = capsys.readouterr().out
    assert "main thread" in out and "test_a_stopped_sampler" in out
