"""What explains a throughput run's spread: profile_throughput's per-second timeline, the
nvidia-smi clock and power sampler (without nvidia-smi too), and the A/B summary's median of pair ratios."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from benchmarks.ab_summary import load, main as ab_main, median_ratio, pair_ratio
from benchmarks.gpu_monitor import GpuMonitor, GpuSample, parse_line, summary
from benchmarks.profile_throughput import StepSample, gpus_in_use, print_timeline, start_vs_rest, timeline

T0 = 1000.0


def step(t: float, tokens: int, running: int, waiting: int, eager: int = 0) -> StepSample:
    return StepSample(T0 + t, tokens, running, waiting, eager)


def test_timeline_buckets_steps_by_wall_clock_second() -> None:
    steps = [step(0.1, 8, 8, 20, eager=1), step(0.6, 6, 6, 18), step(1.5, 5, 5, 10, eager=1), step(3.2, 4, 4, 0)]
    assert timeline(steps, T0) == [
        {"s": 0, "steps": 2, "out_tokens": 14, "running": 7.0, "waiting": 18, "eager_steps": 1,
         "sm_mhz": None, "power_w": None},
        {"s": 1, "steps": 1, "out_tokens": 5, "running": 5.0, "waiting": 10, "eager_steps": 1,
         "sm_mhz": None, "power_w": None},
        # no step ended in second 2 (a stall): the engine still held what the last step left
        {"s": 2, "steps": 0, "out_tokens": 0, "running": 5, "waiting": 10, "eager_steps": 0,
         "sm_mhz": None, "power_w": None},
        {"s": 3, "steps": 1, "out_tokens": 4, "running": 4.0, "waiting": 0, "eager_steps": 0,
         "sm_mhz": None, "power_w": None},
    ]


def test_timeline_merges_gpu_samples_into_their_second() -> None:
    steps = [step(0.5, 1, 1, 0), step(1.5, 1, 1, 0)]
    gpu = [GpuSample(T0 + 0.1, 0, 1980.0, 400.0, 40.0), GpuSample(T0 + 0.6, 0, 1700.0, None, 41.0),
           GpuSample(T0 + 1.2, 0, 1500.0, 300.0, 42.0),
           GpuSample(T0 - 0.1, 0, 1.0, 1.0, 1.0), GpuSample(T0 + 9.0, 0, 1.0, 1.0, 1.0)]  # outside the run
    per_second = timeline(steps, T0, gpu)
    assert [(b["sm_mhz"], b["power_w"]) for b in per_second] == [(1840, 400.0), (1500, 300.0)]


def test_timeline_in_wider_rows_and_without_steps() -> None:
    steps = [step(t, 2, 3, 0) for t in (0.5, 9.9, 10.0, 25.0)]
    rows = timeline(steps, T0, width=10)
    assert [(b["s"], b["steps"], b["out_tokens"]) for b in rows] == [(0, 2, 4), (10, 1, 2), (20, 1, 2)]
    assert timeline([], T0) == []
    first_second = timeline([step(1.5, 2, 3, 0)], T0)[0]
    assert (first_second["steps"], first_second["running"], first_second["waiting"]) == (0, None, None)


def test_start_vs_rest_rates() -> None:
    per_second = timeline([step(5.0, 400, 1, 0), step(19.9, 600, 1, 0), step(29.0, 500, 1, 0)], T0)
    assert start_vs_rest(per_second, wall=30.0) == {"split_s": 20, "out_tok_s_first": 50.0, "out_tok_s_rest": 50.0}
    assert start_vs_rest(per_second[:6], wall=6.0)["out_tok_s_rest"] is None


def test_printed_timeline_in_10_s_rows(capsys: pytest.CaptureFixture[str]) -> None:
    steps = [step(12.5, 30, 4, 0, eager=1), step(25.0, 20, 1, 0)]
    gpu = [GpuSample(T0 + 13.0, 0, 1980.0, 500.0, 40.0)]
    print_timeline(steps, T0, gpu, 25.5, start_vs_rest(timeline(steps, T0), 25.5))
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[1:4] == [["0", "0", "0", "-", "-", "0", "-", "-"], ["10", "1", "3", "4", "0", "1", "1980", "500.0"],
                         ["20", "1", "4", "1", "0", "0", "-", "-"]]
    assert rows[4] == ["out", "tok/s:", "first", "20", "s", "2,", "the", "rest", "4"]


def test_gpus_in_use_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert gpus_in_use(2) == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpus_in_use(2) == ["0", "1"]


def test_parse_nvidia_smi_lines() -> None:
    assert parse_line("0, 1980, 345.67, 45", 1.5) == GpuSample(1.5, 0, 1980.0, 345.67, 45.0)
    assert parse_line("1, 1755, [N/A], 60", 2.0) == GpuSample(2.0, 1, 1755.0, None, 60.0)
    for line in ("", "No devices were found", "index, clocks.sm [MHz], power.draw [W], temperature.gpu"):
        assert parse_line(line, 0.0) is None


def test_summary_per_gpu() -> None:
    samples = [GpuSample(0.0, 0, 1980.0, 400.0, 40.0), GpuSample(0.5, 0, 1500.0, 300.0, 50.0),
               GpuSample(0.0, 1, 1800.0, None, None)]
    assert summary(samples) == {
        "0": {"samples": 2, "sm_mhz_mean": 1740.0, "sm_mhz_min": 1500.0, "sm_mhz_max": 1980.0,
              "power_w_mean": 350.0, "power_w_min": 300.0, "power_w_max": 400.0, "temp_c_max": 50.0},
        "1": {"samples": 1, "sm_mhz_mean": 1800.0, "sm_mhz_min": 1800.0, "sm_mhz_max": 1800.0,
              "power_w_mean": None, "power_w_min": None, "power_w_max": None, "temp_c_max": None},
    }
    assert summary([]) == {}


def test_monitor_without_nvidia_smi_gives_no_samples() -> None:
    monitor = GpuMonitor(executable="no-such-nvidia-smi-here").start()
    assert monitor.stop() == [] and monitor.last() is None


def test_monitor_stops_asking_a_failing_nvidia_smi(tmp_path: Path) -> None:
    failing = tmp_path / "nvidia-smi"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(0o755)
    monitor = GpuMonitor(interval_s=0.01, executable=str(failing)).start()
    monitor._thread.join(2)
    assert not monitor._thread.is_alive() and monitor.stop() == []


def test_monitor_samples_in_the_background(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, 1980, 400.5, 40'\necho '1, 1755, 350.0, 45'\n")
    fake.chmod(0o755)
    monitor = GpuMonitor(gpus=["0", "1"], interval_s=0.01, executable=str(fake))
    assert monitor.command[-1] == "--id=0,1"
    monitor.start()
    deadline = time.monotonic() + 2
    while len(monitor.samples) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = monitor.stop()
    assert len(samples) >= 4 and {s.gpu for s in samples} == {0, 1}
    assert monitor.last() in samples and summary(samples)["1"]["sm_mhz_mean"] == 1755.0


def test_ab_pair_ratios_and_their_median() -> None:
    assert pair_ratio(100.0, 110.0) == pytest.approx(1.1)
    assert pair_ratio(None, 110.0) is None and pair_ratio(100.0, None) is None
    assert median_ratio([1.1, None, 0.9, 1.3]) == pytest.approx(1.1)
    assert median_ratio([1.0, 1.2]) == pytest.approx(1.1)
    assert median_ratio([None]) is None


def test_ab_summary_reads_records_and_skips_missing_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def saved(name: str, out_tok_s: float, **extra) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps([{"out_tok_s": out_tok_s, **extra}]))
        return path

    split = {"split_s": 20, "out_tok_s_first": 6000.0, "out_tok_s_rest": 7800.0}
    before = [saved("b1", 7000.0), saved("b2", 7500.0), saved("b3", 7000.0)]
    after = [saved("a1", 7700.0, timeline_summary=split, gpu_clocks={"0": {"sm_mhz_mean": 1950.0}}),
             saved("a2", 7800.0), tmp_path / "cut_short.json"]
    assert load(after[2]) is None
    monkeypatch.setattr(sys, "argv", ["ab_summary", "--before", *map(str, before), "--after", *map(str, after)])
    ab_main()
    out = capsys.readouterr().out
    assert "after 7700.0 (first 20 s 6000, rest 7800) SM 1950 MHz; after/before 1.100" in out
    assert "pair 3: before 7000.0; after missing; after/before -" in out
    assert "median of 2 pairs: 1.070 (pairs from 1.040 to 1.100)" in out
