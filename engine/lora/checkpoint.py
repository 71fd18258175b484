"""Reading a PEFT LoRA checkpoint: ``adapter_config.json`` plus ``adapter_model.safetensors`` (or the
older ``adapter_model.bin``), as ``peft``'s ``save_pretrained`` writes them.

Each adapted module ``m`` of the base model gets ``W x + scaling * B (A x)`` with ``A`` [r, in] and
``B`` [out, r] (``base_model.model.<m>.lora_A.weight`` / ``lora_B.weight``); ``scaling`` is
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``, where ``r`` and ``lora_alpha``
may differ per module (``rank_pattern`` / ``alpha_pattern``, whose keys match a module name's
ending as peft matches them). The reader returns float32 host tensors with the scaling folded
into ``B``, keyed by the base model's module name in Hugging Face naming; the engine maps them
onto its fused linears (``manager.py``).

Anything the engine cannot apply exactly is refused with ``AdapterError`` naming the fix: a DoRA or
non-LoRA adapter, trained biases, extra trained modules (``modules_to_save``: an adapter with its
own lm_head or embedding no longer shares the base), embedding adapters, projections other than
q/k/v/o/gate/up/down, weights that are missing, mis-shaped or not finite.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...protocol.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
# base_model.model.<module>.lora_A[.<adapter name>].weight
_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRAModule:
    """One adapted module: ``a`` float32 [r, in]; ``b`` float32 [out, r], times its scaling."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class PeftLoRA:
    """A PEFT LoRA adapter as plain tensors."""

    path: Path
    modules: dict[str, LoRAModule]  # base model module name (e.g. model.layers.0.self_attn.q_proj) -> weights
    rank: int  # the largest r over modules
    target_modules: tuple[str, ...]  # short names present, e.g. ("q_proj", "v_proj")
    base_model_name_or_path: str | None


def _pattern_value(patterns: dict, module: str, default):
    """peft's per-module override: the first pattern key that matches the end of ``module``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def resolve_adapter_dir(path: str | Path) -> Path:
    """A local adapter directory, or a hub id (``org/name``) downloaded into the hub cache."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    text = str(path)
    if local.exists():
        raise AdapterError(f"LoRA adapter {text}: is a file; pass the directory holding {CONFIG_FILE} and "
                           f"{WEIGHT_FILES[0]}")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, allow_patterns=[CONFIG_FILE, *WEIGHT_FILES]))
        except Exception as exc:  # no network, no such repo, no access: one message
            raise AdapterError(f"LoRA adapter {text}: not a local directory, and it could not be downloaded from "
                               f"the hub ({type(exc).__name__}); pass a local directory with {CONFIG_FILE} and "
                               f"{WEIGHT_FILES[0]}") from exc
    raise AdapterError(f"LoRA adapter {text}: no such directory; pass a PEFT adapter directory (with {CONFIG_FILE} "
                       f"and {WEIGHT_FILES[0]}, as peft's save_pretrained writes them)")


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is missing; pass a PEFT adapter directory "
                           f"(peft's save_pretrained writes {CONFIG_FILE} and {WEIGHT_FILES[0]})")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"LoRA adapter {path}: peft_type {kind!r}; only LoRA adapters (peft_type LORA) are served")
    refusals = (
        ("use_dora", lambda v: bool(v), "DoRA adapters (use_dora) are not served: train without DoRA or merge it "
                                        "into the base (merge_and_unload)"),
        ("bias", lambda v: v not in (None, "none"), "trained biases (bias != 'none') are not served: train with "
                                                    "bias='none' or merge the adapter into the base"),
        ("lora_bias", lambda v: bool(v), "LoRA biases (lora_bias) are not served: merge the adapter into the base"),
        ("modules_to_save", lambda v: bool(v), "it trains whole modules too (modules_to_save), so it no longer "
                                               "shares the base model: merge it (merge_and_unload) and serve that"),
        ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out (transposed Conv1D weights, GPT-2 style) is not "
                                              "served; the engine adapts Llama-style Linear projections"),
    )
    for name, bad, why in refusals:
        if bad(config.get(name)):
            raise AdapterError(f"LoRA adapter {path}: {name}={config.get(name)!r}: {why}")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise AdapterError(f"LoRA adapter {path}: {CONFIG_FILE} needs {name} > 0, has {value!r}")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = path / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: one message
            raise AdapterError(f"LoRA adapter {path}: {name} could not be read ({exc})") from exc
    raise AdapterError(f"LoRA adapter {path}: no weights file; expected {' or '.join(WEIGHT_FILES)}")


def read_peft_lora(path: str | Path) -> PeftLoRA:
    """The adapter at ``path`` (a directory, or a hub id) as float32 tensors; AdapterError when it is
    not one the engine can apply."""
    path = resolve_adapter_dir(path)
    config = _read_config(path)
    tensors = _read_weights(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding" in key:
            raise AdapterError(f"LoRA adapter {path}: {key}: embedding adapters are not served (only "
                               f"{', '.join(SUPPORTED_TARGETS)})")
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"LoRA adapter {path}: unexpected tensor {key} (not a lora_A / lora_B weight): "
                               "only LoRA weights on linear projections are served")
        pairs.setdefault(match["module"].removeprefix(_PREFIX), {})[match["kind"]] = tensor
    modules: dict[str, LoRAModule] = {}
    for module, pair in pairs.items():
        short = module.rsplit(".", 1)[-1]
        if short not in SUPPORTED_TARGETS:
            raise AdapterError(f"LoRA adapter {path}: it adapts {module}; the engine applies adapters to "
                               f"{', '.join(SUPPORTED_TARGETS)} only")
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"LoRA adapter {path}: {module} has {' and '.join(sorted(pair))} but not both lora_A "
                               "and lora_B")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"LoRA adapter {path}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               "do not make a low-rank pair ([r, in] and [out, r])")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"LoRA adapter {path}: {module}'s weights are not all finite (NaN or inf)")
        r = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if r != a.shape[0]:
            raise AdapterError(f"LoRA adapter {path}: {module} has rank {a.shape[0]} but {CONFIG_FILE} says {r}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[module] = LoRAModule(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise AdapterError(f"LoRA adapter {path}: its weights file holds no lora_A / lora_B tensors")
    targets = tuple(t for t in SUPPORTED_TARGETS if any(m.endswith("." + t) for m in modules))
    return PeftLoRA(path, modules, max(m.a.shape[0] for m in modules.values()), targets,
                    config.get("base_model_name_or_path"))
