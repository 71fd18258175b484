"""Finding a checkpoint and streaming its tensors into a model.

Sources: a Hugging Face directory (``*.safetensors``, sharded via ``model.safetensors.index.json``,
or ``pytorch_model*.bin`` as a fallback), a single ``.gguf`` file (dequantized through
transformers, which needs the ``gguf`` package), or a hub id (downloaded with
``huggingface_hub.snapshot_download``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..protocol.errors import EngineConfigError, UnsupportedModelError
from .hf_config import is_gguf
from .model_config import ModelConfig

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
# Files a hub download needs besides the weights (config, tokenizer, chat template).
_HUB_META_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
# Mistral-format duplicates of the weights and Meta's original checkpoints: not Hugging Face names.
_HUB_IGNORE_PATTERNS = ["consolidated*", "original/*"]
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model_path(model_path: str | Path, revision: str | None = None,
                       download_dir: str | Path | None = None) -> Path:
    """A local model directory or ``.gguf`` file for ``model_path``; hub ids are downloaded first.

    ``revision`` (a branch, tag or commit) and ``download_dir`` (the hub cache directory; None:
    Hugging Face's default) are ``EngineConfig``'s fields of those names and, as in LMDeploy,
    apply to hub ids only: a local path is used as it is.
    """
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if is_gguf(path):
            return path
        raise UnsupportedModelError(
            f"{path} is a file but not a .gguf: pass a Hugging Face model directory or a .gguf file"
        )
    text = str(model_path)
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise EngineConfigError(f"model path {text!r} does not exist (and is not a hub id like 'org/name')")
    return _download_from_hub(text, revision, download_dir)


def _download_from_hub(repo_id: str, revision: str | None, download_dir: str | Path | None = None) -> Path:
    cache_dir = None if download_dir is None else str(Path(download_dir).expanduser())
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir,
            allow_patterns=_HUB_META_PATTERNS + ["*.safetensors"], ignore_patterns=_HUB_IGNORE_PATTERNS,
        ))
        if not any(local.glob("*.safetensors")):
            logger.info("%s has no safetensors weights; downloading pytorch_model*.bin", repo_id)
            local = Path(snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir,
                allow_patterns=_HUB_META_PATTERNS + ["*.bin"], ignore_patterns=_HUB_IGNORE_PATTERNS,
            ))
    except Exception as exc:  # any hub failure gets the same advice
        raise EngineConfigError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Check the id and network access (HF_TOKEN for gated models), or pass a local directory."
        ) from exc
    return local


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig for a local model directory or ``.gguf`` file."""
    return ModelConfig.from_pretrained(path)


def _index_files(model_dir: Path, index_name: str) -> list[Path]:
    index = json.loads((model_dir / index_name).read_text())
    return [model_dir / name for name in sorted(set(index["weight_map"].values()))]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of a Hugging Face directory, safetensors preferred."""
    if (model_dir / _SAFETENSORS_INDEX).exists():
        return _index_files(model_dir, _SAFETENSORS_INDEX)
    files = sorted(model_dir.glob("*.safetensors"))
    hf_named = [f for f in files if not f.name.startswith("consolidated")]
    if hf_named or files:
        return hf_named or files
    if (model_dir / _BIN_INDEX).exists():
        return _index_files(model_dir, _BIN_INDEX)
    files = sorted(model_dir.glob("pytorch_model*.bin")) or sorted(model_dir.glob("*.bin"))
    if files:
        return files
    raise UnsupportedModelError(
        f"no weights found in {model_dir}: expected *.safetensors or pytorch_model*.bin files"
    )


class LazyTensor:
    """A safetensors tensor not read yet: its ``shape``, and reads of a slice along one dim
    (``narrow``), so that a tensor-parallel rank reads only its part of each weight. Valid while
    the iteration that yielded it is on that tensor (the file stays open until then)."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The slice ``[start, start + length)`` of dim ``dim``, read from the file."""
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        """The whole tensor."""
        return self._slice[:]


def materialize(x: torch.Tensor | LazyTensor) -> torch.Tensor:
    """``x`` as a tensor (a LazyTensor is read whole)."""
    return x.materialize() if isinstance(x, LazyTensor) else x


def or_else(weights: Iterable[tuple[str, Any]], prefix: str,
            fallback: Callable[[], Iterable[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors, then, when none was under ``prefix``, the ones ``fallback()`` gives
    (a part some checkpoints leave to another directory: a vision tower)."""
    seen = False
    for name, tensor in weights:
        seen = seen or name.startswith(prefix)
        yield name, tensor
    if not seen:
        yield from fallback()


def narrow(x: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Part of a checkpoint tensor along ``dim``; a LazyTensor reads only that part."""
    return x.narrow(dim, start, length)


def _iter_safetensors(path: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, (LazyTensor(f, name) if lazy else f.get_tensor(name))


def _iter_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        # Pre-zipfile (legacy) checkpoints cannot be memory-mapped.
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    yield from state.items()


def _iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # transformers dequantizes and renames GGUF tensors (and undoes llama.cpp's q/k permutation).
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except ImportError as exc:
        raise UnsupportedModelError(
            f"loading {path.name} needs the gguf package: pip install 'conveyor[gguf]' ({exc})"
        ) from exc
    yield from hf_model.state_dict().items()


def iter_checkpoint(path: str | Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yield (Hugging Face name, CPU tensor) for every weight of a model directory or ``.gguf`` file;
    with ``lazy``, safetensors tensors come as ``LazyTensor`` (read when and where they are used)."""
    path = Path(path)
    if is_gguf(path):
        yield from _iter_gguf(path)
        return
    for file in checkpoint_files(path):
        logger.debug("reading %s", file)
        if file.suffix == ".safetensors":
            yield from _iter_safetensors(file, lazy)
        else:
            yield from _iter_bin(file)


def load_model(model: nn.Module, path: str | Path) -> nn.Module:
    """Stream the checkpoint at ``path`` into ``model`` via its ``load_weights`` (lazily: a
    tensor-parallel rank's layers read only their slices)."""
    model.load_weights(iter_checkpoint(path, lazy=True))
    after_loading(model)
    return model


def after_loading(model: nn.Module) -> None:
    """Let every layer whose method keeps its weights in another layout for its kernels make it,
    once all its tensors are in (AWQ's tensor-core repacking, ``layers/awq_linear.py``)."""
    for module in model.modules():
        finish = getattr(getattr(module, "method", None), "after_loading", None)
        if finish is not None:
            finish(module)
