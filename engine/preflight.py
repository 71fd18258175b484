"""Checks of a model and its engine settings before anything starts.

Every command that loads a model runs ``preflight`` first (``conveyor serve api_server``,
``serve stage``, ``chat``, ``pipeline()``), so that a path that does not exist, a checkpoint that
is cut short or lacks a tensor, or a tensor-parallel size the model cannot split is one message
naming the fix within seconds, not a traceback from every stage 40 s later.

It reads ``config.json`` and the safetensors headers only (a few KB per file, whatever the
weights weigh), builds the model on the meta device (no memory) and feeds the headers' names and
shapes through the model's own ``load_weights``: the check is the loader's, so it cannot drift
from what the engine will read. ``.bin`` and ``.gguf`` weights keep their names inside the data;
for those only the files are checked (the loader reports a missing tensor when it reads them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .. import envs
from ..protocol.errors import ConveyorError, EngineConfigError, UnsupportedModelError
from .config import EngineConfig

if TYPE_CHECKING:
    from .model_config import ModelConfig

logger = logging.getLogger(__name__)

# safetensors' dtype names -> torch's attribute names (the meta tensors carry the checkpoint's dtype,
# which the quantized formats' loaders check).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# Tensors whose values a format reads at load to decide whether they matter (QuantFormat.skips_tensor:
# compressed-tensors' zero points); given as zeros on the CPU instead of meta tensors (they are tiny).
_VALUE_READ_SUFFIXES = (".weight_zero_point",)
_GGUF_MAGIC = b"GGUF"


def preflight(model: str | Path, config: EngineConfig, *, weights: bool = True) -> Path:
    """Check ``model`` and ``config`` before any stage or engine starts; returns the local model path
    (a hub id: its downloaded snapshot). ``weights=False`` (an engine factory's engine, which may
    read nothing) checks the path and config.json only.

    Raises ``EngineConfigError`` (a missing path, a hub id not to be had, a tp the model or the
    machine cannot split over) or ``UnsupportedModelError`` (an architecture, format or checkpoint
    that cannot run), each naming the fix in one line."""
    path = locate_model(model, config.revision, config.download_dir)
    model_config = read_model_config(path)
    if not weights:
        return path
    from .quant_format import resolve_quant_format

    dummy = config.load_format == "dummy"
    model_config.quant = resolve_quant_format(model_config, config.model_format, dummy_weights=dummy)
    check_tensor_parallel(model_config, config)
    if not dummy:
        check_checkpoint(path, model_config)
    return path


# ---- the path ---------------------------------------------------------------------------------------

def looks_local(text: str) -> bool:
    """Whether ``text`` is meant as a path on this machine rather than a hub id ('org/name'):
    absolute, ``./`` or ``../``, ``~``, or under a folder that exists here."""
    if text.startswith(("/", "./", "../", "~")) or text in (".", ".."):
        return True
    parent = Path(text).parent
    return parent != Path(".") and parent.is_dir()


def locate_model(model: str | Path, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local model directory or ``.gguf`` file of ``model``; a hub id is downloaded (or taken
    from the Hugging Face cache). A local-looking path that does not exist is an error, not a hub id."""
    text = str(model)
    path = Path(text).expanduser()
    if not path.exists() and looks_local(text):
        hint = ""
        if not text.startswith(("/", ".", "~")):  # 'org/name' with ./org here: say why it is not the hub's
            hint = f" (read as a local path because {path.parent}/ exists here; for the hub id, run elsewhere)"
        raise EngineConfigError(f"model path {text!r} does not exist{hint}: give a Hugging Face model directory "
                                "(config.json + weights), a .gguf file or a hub id like 'org/name'")
    from .weight_loader import resolve_model_path

    try:
        return resolve_model_path(text, revision, download_dir)
    except EngineConfigError as exc:
        raise _hub_error(text, download_dir, exc) from exc


def _hub_error(repo_id: str, download_dir: str | Path | None, exc: EngineConfigError) -> EngineConfigError:
    """One line for a hub id that could not be had; says so when it is not cached and the hub is unreachable."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return EngineConfigError(_one_line(str(exc)))
    if not isinstance(exc.__cause__, LocalEntryNotFoundError):
        return EngineConfigError(_one_line(str(exc)))
    cache = Path(download_dir).expanduser() if download_dir else constants.HF_HUB_CACHE
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "no network access to the hub"
    return EngineConfigError(
        f"hub id {repo_id!r} is not in the Hugging Face cache ({cache}) and cannot be downloaded ({why}): "
        f"download it where the hub is reachable (`hf download {repo_id}`) and copy that cache here, or give a "
        "local model directory")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ---- config.json --------------------------------------------------------------------------------------

def read_model_config(path: Path) -> ModelConfig:
    """The model's config (config.json, or a .gguf file's metadata), its problems as one-line errors."""
    from .weight_loader import is_gguf, load_model_config

    if is_gguf(path):
        _check_gguf_magic(path)
    elif not (path / "config.json").is_file():
        raise UnsupportedModelError(f"{path} has no config.json: give a Hugging Face model directory "
                                    "(config.json + weights) or a .gguf file")
    try:
        return load_model_config(path)
    except ConveyorError:
        raise
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path / 'config.json'} is not valid JSON ({exc}): download it again") from exc
    except KeyError as exc:
        raise UnsupportedModelError(f"{path}'s config lacks {exc}, which the engine needs: download the model's "
                                    "config.json again") from exc
    except Exception as exc:  # a GGUF file transformers cannot read, an unreadable file
        raise UnsupportedModelError(f"cannot read the config of {path} ({type(exc).__name__}: "
                                    f"{_one_line(str(exc))}): download the model again") from exc


def _check_gguf_magic(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise UnsupportedModelError(f"{path} is not a GGUF file (it does not begin with 'GGUF'): download it "
                                        "again")


# ---- tensor parallel ----------------------------------------------------------------------------------

def check_tensor_parallel(model_config: ModelConfig, config: EngineConfig) -> None:
    """Refuse a tp the model's heads, kv heads or intermediate size (or quantization groups) do not
    split over, or more GPUs than are visible."""
    if config.tp == 1:
        return
    from .distributed import check_tp_shapes
    from .model_registry import check_tp_support

    check_tp_support(model_config.architecture, config.tp)
    quant = model_config.quant
    check_tp_shapes(model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
                    model_config.intermediate_size, config.tp,
                    quant.group_size if quant is not None and quant.method == "awq" else None)
    _check_layer_splits(model_config, config.tp)
    _check_gpu_count(config.tp, config.device)


def _check_layer_splits(model_config: ModelConfig, tp: int) -> None:
    """Every layer's own split (an expert's width, a shared expert's, MLA's heads, a family's
    fused projections): the model built on the meta device as rank 0 of ``tp`` ranks, which
    raises where a shape does not split. No memory is allocated; about a second for the largest."""
    import torch

    from .distributed import as_first_of
    from .models import build_model

    with as_first_of(tp):
        build_model(model_config, dtype=torch.bfloat16, device="meta")


def _check_gpu_count(tp: int, device: str) -> None:
    """The engine's device choice (``engine_inputs.pick_device``), refused before it is made: a rank per GPU."""
    if device != "auto" and not device.startswith("cuda"):
        return  # the CPU: the ranks share it, joined by gloo
    import torch

    if device == "auto" and not torch.cuda.is_available():
        return
    if ":" in device:
        raise EngineConfigError(f"device={device!r} names one GPU but tp={tp}: use device='cuda' (rank r takes "
                                "cuda:r) and choose the GPUs with CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()  # does not initialize CUDA (the stages are spawned after this)
    if tp > count:
        visible = envs.cuda_visible_devices()
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise EngineConfigError(f"tp={tp} needs {tp} GPUs, one per rank; {count} visible{shown}: lower tp to "
                                f"{max(count, 1)} or make {tp} GPUs visible")


# ---- the weights --------------------------------------------------------------------------------------

def check_checkpoint(path: Path, model_config: ModelConfig) -> None:
    """The weight files are there and readable, and (safetensors) hold every tensor the model needs
    in the shape it needs; reads the files' headers only."""
    from .weight_loader import checkpoint_files, is_gguf

    if is_gguf(path):
        return  # read whole by transformers, which renames its tensors: nothing to check by name
    try:
        files = checkpoint_files(path)
    except (json.JSONDecodeError, KeyError) as exc:  # a weight index that is not one
        raise UnsupportedModelError(f"{path}'s weight index (*.index.json) cannot be read ({type(exc).__name__}: "
                                    f"{exc}): download it again") from exc
    absent = [f for f in files if not f.is_file()]
    if absent:
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        raise UnsupportedModelError(f"{path}'s weight index names {absent[0].name}{more}, which is not there: "
                                    "download the checkpoint again")
    shapes: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        if file.stat().st_size == 0:
            raise UnsupportedModelError(f"{file} is empty: download the checkpoint again")
        if file.suffix != ".safetensors":
            return  # a pickle: its names are inside the data, which the loader reads
        shapes.update(safetensors_header(file))
    _dry_load(path, model_config, shapes)


def safetensors_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (safetensors dtype, shape)} of one file, from its header (the library checks
    that the file holds every byte the header describes)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {name: (s.get_dtype(), s.get_shape()) for name in f.keys() for s in (f.get_slice(name),)}
    except (SafetensorError, OSError) as exc:
        raise UnsupportedModelError(f"{file} is not a readable safetensors file ({_one_line(str(exc))}): it is "
                                    "damaged or cut short; download it again") from exc


def _dry_load(path: Path, model_config: ModelConfig, shapes: dict[str, tuple[str, list[int]]]) -> None:
    """Run the model's ``load_weights`` on the meta device with tensors of the headers' shapes."""
    import torch

    from .models import build_model

    def tensors():
        for name, (dtype, shape) in shapes.items():
            device = "cpu" if name.endswith(_VALUE_READ_SUFFIXES) else "meta"
            yield name, torch.zeros(shape, dtype=getattr(torch, _DTYPES.get(dtype, "float32")), device=device)

    try:
        model = build_model(model_config, dtype=torch.float32, device="meta")
        model.load_weights(tensors())
    except (ConveyorError, ValueError) as exc:  # what the loader says of a checkpoint that does not fit
        raise UnsupportedModelError(f"{path}: {_one_line(str(exc))}") from exc
    except Exception as exc:  # noqa: BLE001 - an operation the meta device lacks: the real load checks
        logger.debug("the checkpoint's tensors were not checked before loading: %s: %s", type(exc).__name__, exc)
