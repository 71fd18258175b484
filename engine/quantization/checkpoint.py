"""Writing and reading quantized checkpoints: Hugging Face directories the engine (and others) load.

* AWQ, in AutoAWQ's "gemm" layout: a quantized linear ``<name>`` is stored as ``<name>.qweight``
  / ``.qzeros`` / ``.scales``; ``quantization_config`` says ``quant_method: awq``, ``version: gemm``.
* W8A8, in compressed-tensors' "int-quantized" layout (what llm-compressor writes and vLLM reads):
  ``<name>.weight`` int8 ``[out, in]`` and ``<name>.weight_scale`` float32 ``[out, 1]``;
  ``quantization_config`` says ``quant_method: compressed-tensors`` with one config group of
  symmetric per-channel int8 weights and dynamic symmetric per-token int8 input activations.

Either way a linear's ``.bias`` and every other tensor (embeddings, norms, an untied ``lm_head``)
is float16, and the tokenizer, chat template and generation config are copied. A directory is written next to its
destination and renamed into place at the end, so a failure never leaves a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .awq_layout import dequantize_awq_ref
from .config import QuantizationError

_SHARD_BYTES = 4 << 30
# Files of a model directory that are weights (or their index) and so are not copied as they are.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def quantization_config(bits: int, group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` entry of an AWQ checkpoint's config.json (AutoAWQ / LMDeploy keys)."""
    return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}


def w8a8_quantization_config(ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``quantization_config`` of a W8A8 checkpoint: compressed-tensors' int8 scheme, as llm-compressor
    writes it for symmetric per-channel weights and dynamic per-token activations. ``ignore``: linears
    left 16-bit besides the LM head (MoE routers, by compressed-tensors' ``re:`` patterns)."""
    def int8(strategy: str, dynamic: bool) -> dict[str, Any]:
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}}

    group = {"targets": ["Linear"], "weights": int8("channel", False), "input_activations": int8("token", True),
             "output_activations": None, "format": "int-quantized"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", *ignore], "kv_cache_scheme": None}


def check_work_dir(work_dir: str | Path) -> Path:
    """``work_dir`` as a Path, if it can receive a new checkpoint (absent or an empty directory)."""
    path = Path(work_dir).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise QuantizationError(
            f"--work-dir {path} already exists and is not an empty directory: remove it or choose another")
    return path


@contextlib.contextmanager
def atomic_directory(work_dir: str | Path) -> Iterator[Path]:
    """A temporary directory beside ``work_dir`` that becomes ``work_dir`` when the block succeeds.

    On any exception the temporary directory is deleted and ``work_dir`` is left as it was.
    """
    dest = check_work_dir(work_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
        if dest.exists():
            dest.rmdir()  # empty, checked above
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def copy_side_files(src_dir: Path, dest_dir: Path) -> None:
    """Copy the model directory's non-weight files (tokenizer, chat template, generation config)."""
    for item in src_dir.iterdir():
        if not item.is_file() or item.name == "config.json" or item.name in _WEIGHT_INDEXES:
            continue
        if item.suffix.lower() in _WEIGHT_SUFFIXES:
            continue
        shutil.copy2(item, dest_dir / item.name)


def _write_config(src_dir: Path, dest_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((src_dir / "config.json").read_text())
    edit(config)
    (dest_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _set_dtype(config: dict[str, Any], dtype: str) -> None:
    # transformers 5 writes "dtype", older versions "torch_dtype"; keep whichever is there.
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtype


def save_state_dict(tensors: Mapping[str, torch.Tensor], dest_dir: Path) -> None:
    """Write ``tensors`` as ``model.safetensors``, or as shards with an index past 4 GiB."""
    from safetensors.torch import save_file

    def save(shard: dict[str, torch.Tensor], path: Path) -> None:
        save_file(shard, str(path), metadata={"format": "pt"})
        path.chmod(0o666 & ~_umask())  # safetensors (0.8 here) writes its files private (0600)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save(shards[0], dest_dir / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save(shard, dest_dir / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def quantized_state_dict(state: Mapping[str, torch.Tensor], packed: Mapping[str, Mapping[str, torch.Tensor]],
                         tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: ``packed`` (linear name -> its stored tensors, e.g. qweight/qzeros/scales)
    in place of each quantized linear's weight, plus the rest in float16."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # tied to model.embed_tokens.weight, which is saved
        base, _, leaf = name.rpartition(".")
        if leaf == "weight" and base in packed:
            for key, value in packed[base].items():
                out[f"{base}.{key}"] = value.cpu()
        else:
            out[name] = tensor.detach().to(torch.float16).cpu() if tensor.is_floating_point() else tensor.cpu()
    missing = [base for base, stored in packed.items() if not all(f"{base}.{key}" in out for key in stored)]
    if missing:
        raise ValueError(f"quantized layers missing from the model's state dict: {sorted(missing)[:5]}")
    return out


def write_quantized_checkpoint(src_dir: str | Path, dest_dir: Path, tensors: Mapping[str, torch.Tensor],
                               quant_config: dict[str, Any]) -> None:
    """Fill ``dest_dir`` with a quantized checkpoint: weights, config.json with ``quant_config``, side files."""
    src = Path(src_dir)
    save_state_dict(tensors, dest_dir)

    def edit(config: dict[str, Any]) -> None:
        _set_dtype(config, "float16")
        config["quantization_config"] = quant_config

    _write_config(src, dest_dir, edit)
    copy_side_files(src, dest_dir)


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_awq_config(awq_dir: str | Path) -> dict[str, Any]:
    """The ``quantization_config`` of an AWQ directory; raises if it is not an AWQ gemm checkpoint."""
    config = json.loads((Path(awq_dir) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "awq" or quant.get("version", "gemm") != "gemm" or quant.get("bits") != 4:
        raise QuantizationError(f"{awq_dir} is not a 4-bit AWQ 'gemm' checkpoint (quantization_config={quant})")
    return quant


def dequantize_checkpoint(awq_dir: str | Path, work_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write an unquantized copy of an AWQ checkpoint: each linear's weight is its dequantized value.

    The copy computes exactly what the quantized model computes (up to the kernels' arithmetic),
    so any engine that loads Hugging Face checkpoints can evaluate an AWQ model with it.
    """
    src = Path(awq_dir)
    group_size = read_awq_config(src)["group_size"]
    tensors = dict(_iter_safetensors(src))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "qweight":
            weight = dequantize_awq_ref(tensor, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], group_size)
            out[f"{base}.weight"] = weight.t().contiguous().to(dtype)
        elif leaf in ("qzeros", "scales") and f"{base}.qweight" in tensors:
            continue
        else:
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    with atomic_directory(work_dir) as tmp:
        save_state_dict(out, tmp)

        def edit(config: dict[str, Any]) -> None:
            config.pop("quantization_config", None)
            _set_dtype(config, str(dtype).replace("torch.", ""))

        _write_config(src, tmp, edit)
        copy_side_files(src, tmp)
    return Path(work_dir)
