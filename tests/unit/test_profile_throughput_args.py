"""Benchmark arguments refused with the form they want: profile_throughput's --profile window,
profile_restful_api's --workers, gemv_vs_cublas's --tp, bench_lora_kernels' --gemv-tiles."""

import argparse

import pytest

from benchmarks.profile_throughput import profile_window


def test_profile_window_parses_start_and_count() -> None:
    assert profile_window("800:30") == (800, 30)
    assert profile_window("0:1") == (0, 1)


@pytest.mark.parametrize("text", ["800", "a:b", "1:2:3", "-1:5", "10:0"])
def test_profile_window_refuses_bad_windows(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="START"):
        profile_window(text)


def test_profile_needs_a_gpu(monkeypatch, capsys) -> None:
    import sys

    import torch

    from benchmarks import profile_throughput

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["profile_throughput", "--model", "tiny", "--profile", "10:5"])
    with pytest.raises(SystemExit) as exc:
        profile_throughput.main()
    assert exc.value.code == 2 and "needs a GPU" in capsys.readouterr().err


def test_a_negative_gpu_sample_interval_is_refused(monkeypatch, capsys) -> None:
    import sys

    from benchmarks import profile_throughput

    monkeypatch.setattr(sys, "argv", ["profile_throughput", "--model", "tiny", "--gpu-sample-s", "-1"])
    with pytest.raises(SystemExit) as exc:
        profile_throughput.main()
    assert exc.value.code == 2 and "or 0 for none" in capsys.readouterr().err


def test_served_benchmark_refuses_no_client_process(monkeypatch, capsys) -> None:
    """profile_restful_api --workers below 1 is refused before any server is asked."""
    import sys

    from benchmarks import profile_restful_api

    monkeypatch.setattr(sys, "argv", ["profile_restful_api", "--port", "1", "--workers", "0"])
    with pytest.raises(SystemExit) as exc:
        profile_restful_api.main()
    assert exc.value.code == 2 and "--workers 0: give at least 1 client process" in capsys.readouterr().err


def test_a_stack_samples_directory_that_cannot_be_made_is_refused(monkeypatch, capsys, tmp_path) -> None:
    """--stack-samples under a file is refused before any engine is built."""
    import sys

    from benchmarks import profile_throughput

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(sys, "argv", ["profile_throughput", "--model", "tiny", "--stack-samples", str(blocker / "s")])
    with pytest.raises(SystemExit) as exc:
        profile_throughput.main()
    assert exc.value.code == 2 and "--stack-samples" in capsys.readouterr().err


def test_gemv_vs_cublas_takes_one_ranks_shapes_and_refuses_a_tp_they_do_not_split_over(monkeypatch, capsys) -> None:
    """``--tp 2``: qkv, gate_up and the head halve their outputs, o_proj and down their inputs;
    ``--tp 3`` is refused before any GPU work, naming what splits."""
    import sys

    from benchmarks import gemv_vs_cublas

    shapes = gemv_vs_cublas.rank_shapes(2)
    assert shapes["qkv"] == (6144, 4096) and shapes["o_proj"] == (4096, 2048) and shapes["down"] == (4096, 5504)
    for tp in ("3", "0"):
        monkeypatch.setattr(sys, "argv", ["gemv_vs_cublas", "--tp", tp])
        with pytest.raises(SystemExit):
            gemv_vs_cublas.main()
        assert "split evenly over 1, 2, 4 or 8 ranks" in capsys.readouterr().err


def test_bench_lora_kernels_reads_gemv_tiles_as_block_n_by_warps() -> None:
    from benchmarks.bench_lora_kernels import tile_arg

    assert tile_arg("16x8") == (16, 8) and tile_arg("4X4") == (4, 4)
    for text in ("16", "16x", "axb", "4x4x4", "12x4", "0x4", "16x3", "-4x4"):
        with pytest.raises(argparse.ArgumentTypeError, match="BLOCK_NxWARPS"):
            tile_arg(text)
