"""Fetching the default model is safe when several processes do it at once, and leaves nothing
behind when it fails (the download and the conversion are replaced by quick fakes)."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from conveyor import default_model


def _fake_download(workdir: Path) -> Path:
    time.sleep(0.3)  # long enough for the other process to arrive while this one works
    out = workdir / "nested" / default_model.GGUF_NAME
    out.parent.mkdir(parents=True)
    out.write_bytes(b"GGUF fake")
    return out


def _fake_convert(gguf: Path, out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"\0" * 4096)
    time.sleep(0.5)
    (out / "config.json").write_text("{}")
    with open(out.parent / "conversions.log", "a") as f:  # one line per conversion really run
        f.write(f"{out.name}\n")


def _fetch_in_child(dest: Path, results) -> None:
    try:
        results.put(str(default_model.fetch(dest, report=lambda line: None)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put(f"error: {type(exc).__name__}: {exc}")


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(default_model, "_download_gguf", _fake_download)
    monkeypatch.setattr(default_model, "_convert_into", _fake_convert)


def test_two_processes_fetching_at_once_both_get_the_model_built_once(tmp_path, fakes) -> None:
    dest = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    ctx = mp.get_context("fork")  # the children inherit the fakes
    results = ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_child, args=(dest, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert sorted(results.get(timeout=5) for _ in procs) == [str(dest)] * 2
    assert (dest / "config.json").exists() and dest.with_suffix(".gguf").read_bytes() == b"GGUF fake"
    assert len((dest.parent / "conversions.log").read_text().splitlines()) == 1
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted(
        [dest.name, dest.name + ".gguf", dest.name + ".lock", "conversions.log"])


def test_a_failed_conversion_leaves_no_temporary_folder_and_the_next_fetch_works(tmp_path, fakes, monkeypatch) -> None:
    dest = tmp_path / "SmolLM2-135M-Instruct"

    def broken(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"\0" * 4096)
        raise OSError("disk full")

    monkeypatch.setattr(default_model, "_convert_into", broken)
    with pytest.raises(OSError, match="disk full"):
        default_model.fetch(dest, report=lambda line: None)
    assert not dest.exists() and not list(tmp_path.glob("*.partial*"))
    monkeypatch.setattr(default_model, "_convert_into", _fake_convert)
    assert default_model.fetch(dest, report=lambda line: None) == dest and (dest / "config.json").exists()


def test_leftovers_of_a_killed_fetch_are_removed(tmp_path, fakes) -> None:
    dest = tmp_path / "SmolLM2-135M-Instruct"
    (tmp_path / "SmolLM2-135M-Instruct.partial").mkdir()  # the fixed name older versions used
    (tmp_path / "SmolLM2-135M-Instruct.partial" / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / "SmolLM2-135M-Instruct.partial-abc123").mkdir()
    lines: list[str] = []
    default_model.fetch(dest, report=lines.append)
    assert not list(tmp_path.glob("*.partial*"))
    assert any("downloading" in line for line in lines) and any("converting" in line for line in lines)


def test_the_default_model_is_found_by_its_name(tmp_path, fakes, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_TEST_MODEL", str(tmp_path / "m"))
    monkeypatch.chdir(tmp_path)
    for name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", None):
        assert default_model.local_path(name) == str(tmp_path / "m")
    assert default_model.local_path("/some/other/model") == "/some/other/model"
