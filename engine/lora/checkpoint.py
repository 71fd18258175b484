"""Reading a PEFT LoRA checkpoint: ``adapter_config.json`` plus ``adapter_model.safetensors`` (or the
older ``adapter_model.bin``), as ``peft``'s ``save_pretrained`` writes them.

Each adapted module ``m`` of the base model computes ``W x + scaling * B (A x)`` with ``A`` [r, in]
and ``B`` [out, r], saved as ``base_model.model.<m>.lora_A.weight`` / ``lora_B.weight`` (older saves
keep the adapter's name: ``lora_A.default.weight``). ``scaling`` is ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``, where ``r`` and ``lora_alpha`` may differ per module
(``rank_pattern`` / ``alpha_pattern``). The reader returns float32 host tensors with the scaling
folded into ``B``, keyed by the base model's module name in Hugging Face naming; the engine maps
them onto its fused linears (``manager.py``). It needs torch and safetensors only, not peft.

Which modules an adapter covers is what its weights file holds; the config must agree, as peft
reads it when it loads the adapter (``target_modules``, ``exclude_modules``,
``layers_to_transform``: weights the config does not select would be dropped by peft, so a
mismatch is refused rather than served differently). The matching rules mirror peft's
(``check_target_module_exists`` and ``get_pattern_key`` in peft 0.21).

Anything the engine cannot apply exactly is refused with ``AdapterError`` naming the file and the
fix: another PEFT method, a LoRA variant with a different forward (DoRA, aLoRA, ...), an adapter
trained against changed base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA before conversion),
trained biases, whole trained modules (``modules_to_save``: an adapter with its own lm_head or
embedding no longer shares the base), embedding adapters, projections other than
q/k/v/o/gate/up/down, and weights that are missing, unpaired, mis-shaped or not finite.
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
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # peft's order of preference
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
# <module>.lora_A[.<adapter name>].weight
_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
# The same rule as the engine's resolve_model_path (engine/weight_loader.py): org/name.
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_EXPECTED = f"{CONFIG_FILE} and {WEIGHT_FILES[0]} (or {WEIGHT_FILES[1]}), as peft's save_pretrained writes them"
_MERGE = "merge it into the base (peft's merge_and_unload) and serve the merged model"

# Config fields that make peft's forward something other than W x + scaling * B A x, or that train
# more than the LoRA pairs: refused when set (truthy). peft 0.21's LoRA variants are the fields it
# tags is_lora_variant.
_REFUSED_FIELDS = {
    "use_dora": f"DoRA (use_dora) rescales the adapted weight, which the engine does not do: {_MERGE}",
    "lora_bias": f"it trains a bias on lora_B (lora_bias), which the engine does not add: {_MERGE}",
    "modules_to_save": ("it trains whole modules too (modules_to_save, e.g. an lm_head or embedding), so it no "
                        f"longer shares the base model: {_MERGE}"),
    "trainable_token_indices": f"it trains embedding rows (trainable_token_indices): {_MERGE}",
    "target_parameters": f"it adapts parameters rather than linear modules (target_parameters): {_MERGE}",
    "layer_replication": ("it duplicates base layers (layer_replication), so the model it adapts is not the base: "
                          f"{_MERGE}"),
    "use_qalora": f"QA-LoRA (use_qalora) pools the input of lora_A: {_MERGE}",
    "alora_invocation_tokens": ("activated LoRA (alora_invocation_tokens) applies only after its invocation "
                                "tokens, which the engine does not track: serve it with peft"),
    "arrow_config": "Arrow routing (arrow_config) mixes several adapters per token: serve it with peft",
    "use_bdlora": f"block-diagonal LoRA (use_bdlora) is not served: {_MERGE}",
    "velora_config": f"VeLoRA (velora_config) is not served: {_MERGE}",
    "monteclora_config": f"MonteCLoRA (monteclora_config) is not served: {_MERGE}",
    "kasa_config": f"KaSA (kasa_config) is not served: {_MERGE}",
}
# init_lora_weights values that rewrite the base weights at initialisation: the adapter then only
# holds against that residual base. peft's save_pretrained(path_initial_model_for_weight_conversion=...)
# turns such an adapter into a plain one (init_lora_weights true, twice the rank).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class LoRAModule:
    """One adapted module: ``a`` float32 [r, in] (lora_A); ``b`` float32 [out, r] (lora_B times the
    module's scaling), so the module's delta is ``b @ a``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class PeftLoRA:
    """A PEFT LoRA adapter as plain tensors."""

    path: Path  # the local directory read (the hub cache's copy for a hub id)
    modules: dict[str, LoRAModule]  # base model module name (e.g. model.layers.0.self_attn.q_proj) -> weights
    rank: int  # the largest r over modules
    target_modules: tuple[str, ...]  # short names present, in SUPPORTED_TARGETS order, e.g. ("q_proj", "v_proj")
    base_model_name_or_path: str | None


def read_peft_lora(path: str | Path, *, download_dir: str | Path | None = None) -> PeftLoRA:
    """The adapter at ``path`` (a local directory, or a hub id ``org/name`` downloaded into
    ``download_dir``, None: Hugging Face's cache) as float32 tensors; AdapterError naming the fix
    when it is not one the engine can apply."""
    path = resolve_adapter_dir(path, download_dir)
    config = _read_config(path)
    pairs = _lora_pairs(path, _read_weights(path))
    where = f"LoRA adapter {path}"
    modules: dict[str, LoRAModule] = {}
    for module, pair in pairs.items():
        if not _selected(config, module):
            raise AdapterError(
                f"{where}: its weights hold {module}, which {CONFIG_FILE} does not select (target_modules "
                f"{config.get('target_modules')!r}, exclude_modules {config.get('exclude_modules')!r}, "
                f"layers_to_transform {config.get('layers_to_transform')!r}), so peft would drop them: fix "
                f"{CONFIG_FILE} or save the adapter again with peft's save_pretrained")
        modules[module] = _module(where, config, module, pair)
    if not modules:
        raise AdapterError(f"{where}: its weights file holds no lora_A / lora_B tensors; expected {_EXPECTED}")
    targets = tuple(t for t in SUPPORTED_TARGETS if any(m.rsplit(".", 1)[-1] == t for m in modules))
    base = config.get("base_model_name_or_path")
    return PeftLoRA(path, modules, max(m.a.shape[0] for m in modules.values()), targets,
                    base if isinstance(base, str) and base else None)


def resolve_adapter_dir(path: str | Path, download_dir: str | Path | None = None) -> Path:
    """A local adapter directory, or a hub id (``org/name``) downloaded into the hub cache (its
    config and weights only)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    text = str(path)
    if local.exists():
        raise AdapterError(f"LoRA adapter {text}: is a file; pass the directory holding {_EXPECTED}")
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise AdapterError(f"LoRA adapter {text}: no such directory; pass a PEFT adapter directory (with {_EXPECTED}) "
                           "or a hub id like 'org/name'")
    cache_dir = None if download_dir is None else str(Path(download_dir).expanduser())
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, cache_dir=cache_dir, allow_patterns=[CONFIG_FILE, *WEIGHT_FILES]))
    except Exception as exc:  # no network, no such repo, no access: one message with the way out
        raise AdapterError(
            f"LoRA adapter {text}: no local directory of that name, and it could not be downloaded from the Hugging "
            f"Face hub ({type(exc).__name__}: {exc}); pass a local directory with {_EXPECTED} (check the id, network "
            "access and HF_TOKEN for a private repo)") from exc


def _read_config(path: Path) -> dict:
    """adapter_config.json, checked for what the engine cannot apply."""
    file = path / CONFIG_FILE
    where = f"LoRA adapter {path}"
    if not file.is_file():
        raise AdapterError(f"{where}: {CONFIG_FILE} is missing; pass a PEFT adapter directory with {_EXPECTED}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc}); save the adapter again with peft's "
                           "save_pretrained") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object; save the adapter again with peft's "
                           "save_pretrained")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{where}: {CONFIG_FILE} has peft_type {kind!r}; only LoRA adapters (peft_type \"LORA\") "
                           "are served")
    for name, why in _REFUSED_FIELDS.items():
        if config.get(name):
            raise AdapterError(f"{where}: {CONFIG_FILE} sets {name}={config[name]!r}: {why}")
    if config.get("bias", "none") not in (None, "none"):
        raise AdapterError(f"{where}: {CONFIG_FILE} sets bias={config['bias']!r}: it trains the base's biases, which "
                           f"the engine does not apply; train with bias='none' or {_MERGE}")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(
            f"{where}: {CONFIG_FILE} sets init_lora_weights={init!r}: that initialisation changes the base weights, "
            "so the adapter does not hold against the base model; convert it to a plain LoRA adapter (peft's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...)) or merge it into its base")
    if not _is_rank(config.get("r")):
        raise AdapterError(f"{where}: {CONFIG_FILE} needs r, a positive integer; has {config.get('r')!r}")
    if not _is_number(config.get("lora_alpha")):
        raise AdapterError(f"{where}: {CONFIG_FILE} needs lora_alpha, a number; has {config.get('lora_alpha')!r}")
    for name, check, what in (("rank_pattern", _is_rank, "positive integers"), ("alpha_pattern", _is_number,
                                                                                  "numbers")):
        patterns = config.get(name) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) and check(v) for k, v in patterns.items()):
            raise AdapterError(f"{where}: {CONFIG_FILE}'s {name} must map module name patterns to {what}; has "
                               f"{patterns!r}")
        for key in patterns:
            _regex(where, name, key)
    for name in ("target_modules", "exclude_modules"):  # a string is one regex over whole module names
        value = config.get(name)
        if isinstance(value, str) and value.lower() != "all-linear":
            _regex(where, name, value)
    # fan_in_fan_out says the *base* weight is stored [in, out] (GPT-2's Conv1D); peft's lora_A and
    # lora_B are nn.Linear whatever the base, so the pair is [r, in] / [out, r] either way, and peft
    # itself turns the flag off on nn.Linear bases. Nothing to transpose here; the engine's
    # projections are [out, in] and manager.py checks the shapes against them.
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
            raise AdapterError(f"LoRA adapter {path}: {name} could not be read ({type(exc).__name__}: {exc}); save "
                               "the adapter again with peft's save_pretrained") from exc
    raise AdapterError(f"LoRA adapter {path}: no weights file; expected {' or '.join(WEIGHT_FILES)} beside "
                       f"{CONFIG_FILE}, as peft's save_pretrained writes them")


def _lora_pairs(path: Path, tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {"lora_A": tensor, "lora_B": tensor}}; any other tensor refused, by what it is."""
    where = f"LoRA adapter {path}"
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    adapters: set[str | None] = set()
    # The kinds that say what the adapter is come first: peft saves a targeted embedding's whole
    # base weight beside its lora_embedding pair, and that is not the tensor to name.
    for key in tensors:
        if "lora_embedding_A" in key or "lora_embedding_B" in key:
            raise AdapterError(f"{where}: {key}: embedding adapters are not served (only "
                               f"{', '.join(SUPPORTED_TARGETS)} take adapters): {_MERGE}")
        if "lora_magnitude_vector" in key:
            raise AdapterError(f"{where}: {key}: DoRA adapters are not served: {_MERGE}")
    others = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or not isinstance(tensor, torch.Tensor):
            others.append(key)
            continue
        module = match["module"].removeprefix(_PREFIX)
        adapters.add(match["adapter"])
        if len(adapters) > 1:
            raise AdapterError(f"{where}: its weights hold more than one adapter ({sorted(map(str, adapters))}); save "
                               "each adapter in its own directory")
        pairs.setdefault(module, {})[match["kind"]] = tensor
    for module in pairs:
        if module.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS:
            raise AdapterError(f"{where}: it adapts {module}; the engine applies adapters to "
                               f"{', '.join(SUPPORTED_TARGETS)} only: train without that target or {_MERGE}")
    if others:  # after the targets: peft saves e.g. a targeted lm_head's base weight beside its pair
        raise AdapterError(f"{where}: unexpected tensor {others[0]} (not a lora_A / lora_B weight): only LoRA pairs "
                           f"on {', '.join(SUPPORTED_TARGETS)} are served; {_MERGE}")
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            have = next(iter(pair))
            missing = "lora_B" if have == "lora_A" else "lora_A"
            raise AdapterError(f"{where}: {module} has {have} but no {missing}; the weights file is incomplete: save "
                               "the adapter again with peft's save_pretrained")
    return pairs


def _module(where: str, config: dict, module: str, pair: dict[str, torch.Tensor]) -> LoRAModule:
    """One module's pair, checked and scaled as peft scales it."""
    a, b = pair["lora_A"].float(), pair["lora_B"].float()
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
        raise AdapterError(f"{where}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a "
                           "low-rank pair (lora_A [r, in], lora_B [out, r]); save the adapter again with peft")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{where}: {module}'s weights are not all finite (NaN or inf): the training diverged; "
                           "use an earlier checkpoint")
    r = _pattern_value(config.get("rank_pattern"), module, config["r"])
    if r != a.shape[0]:
        raise AdapterError(f"{where}: {module} has rank {a.shape[0]} but {CONFIG_FILE} says r={r} (r, rank_pattern): "
                           "the config does not belong to these weights; save the adapter again with peft")
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return LoRAModule(a.contiguous(), (b * scaling).contiguous())


def _pattern_value(patterns: dict | None, module: str, default):
    """A per-module override as peft picks it (``get_pattern_key``): the first key, in the config's
    order, that matches the end of the module name at a dot boundary, as a regex."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _selected(config: dict, module: str) -> bool:
    """Whether peft, loading this config, puts a LoRA layer on ``module`` (its
    ``check_target_module_exists``; ``modules_to_save`` is refused before this)."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, module):
                return False
        elif module in exclude or any(module.endswith(f".{e}") for e in exclude):
            return False
    targets = config.get("target_modules")
    if targets is None:  # peft fills this in before saving; a hand-written config may leave it out
        return True
    if isinstance(targets, str):
        # "all-linear" is peft's shorthand, expanded to every linear but the output layer when the
        # adapter was made; any module a supported target names is one of those.
        return targets.lower() == "all-linear" or re.fullmatch(targets, module) is not None
    if module in targets:
        return True
    if not any(module.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = config.get("layers_pattern")
    match = None
    if not pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)  # the first numbered segment: the layer index
    else:
        for p in [pattern] if isinstance(pattern, str) else pattern:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match["idx"])
    return index == layers if isinstance(layers, int) else index in layers


def _regex(where: str, field: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE}'s {field} {pattern!r} is not a valid regular expression "
                           f"({exc}); fix {CONFIG_FILE}") from exc


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
