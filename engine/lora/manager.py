"""The engine's LoRA adapters: registered by name, paged into a fixed pool of device slots.

An adapter is read once (``checkpoint.read_peft_lora``), checked against the base model, and kept
on the host as each target linear's slot contents, already in this rank's share and the pool's
dtype and rank (pinned on CUDA, so paging it in is a plain asynchronous copy). The device holds
``num_slots`` adapters at a time (``layers/lora.LoRASlots`` beside every target linear); the model
runner asks ``slots_for`` each step, which keeps the slots of the step's adapters and pages
missing ones into free slots or over the least recently used ones the step does not need. The
scheduler admits at most ``num_slots`` distinct adapters into the running batch, so a step always
fits. Paging is queued on the device's stream: a step still running on a slot's old adapter
reads it before the copy lands.

Adapter ids are never reused: the prefix cache keys blocks by them (an adapter unloaded and loaded
again under the same name gets a new id, so its blocks are never taken for the old one's).
Unloading forgets the name at once; the weights go when no sequence runs with them (``unused``).

Which linears take adapters comes from the model's own checkpoint-name mapping (``map_weight``):
Hugging Face's ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``, as
PEFT names them, land on the fused ``qkv_proj`` / ``gate_up_proj`` parts the engine runs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from ...protocol.errors import AdapterError, EngineConfigError
from ..layers.linear import LinearBase, MergedLinear
from ..layers.lora import LoRASlots
from .checkpoint import PeftLoRA, read_peft_lora

logger = logging.getLogger(__name__)

# PEFT's target module names the engine applies, and the decoder block that holds each.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
DEFAULT_MAX_RANK = 16  # vLLM's default --max-lora-rank
DEFAULT_MAX_SLOTS = 8  # slots when the start-up adapters are more and max_loras is not set
_RANK_STEP = 16  # the kernels' rank granularity (tl.dot needs 16)


@dataclass(frozen=True)
class Target:
    """Where a Hugging Face module's adapter goes: a linear (by module path) and its part."""

    linear: str
    part: int


@dataclass
class Adapter:
    """One registered adapter: its id, name, rank, and each target linear's slot contents."""

    adapter_id: int
    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    live: bool = True  # False once unloaded: its name is free, its weights wait for its last sequence


def pool_shape(config, start_ranks: list[int]) -> tuple[int, int]:
    """(slots, largest rank) of the pool: ``max_loras`` / ``max_lora_rank`` when set, else one
    slot for each start-up adapter (at most ``DEFAULT_MAX_SLOTS``) and the largest of their ranks
    (at least ``DEFAULT_MAX_RANK``)."""
    slots = config.max_loras or min(max(len(start_ranks), 1), DEFAULT_MAX_SLOTS)
    return slots, config.max_lora_rank or max([DEFAULT_MAX_RANK, *start_ranks])


def target_linears(model: nn.Module, num_layers: int) -> dict[str, Target]:
    """Each Hugging Face module name PEFT may target (``model.layers.{i}.self_attn.q_proj``, ...)
    -> the linear and part it maps to in ``model``; raises EngineConfigError when the model maps
    none (LoRA needs Llama-style projections)."""
    map_weight = getattr(model, "map_weight", None)
    targets: dict[str, Target] = {}
    if map_weight is not None:
        for i in range(num_layers):
            for short, block in TARGET_MODULES.items():
                hf = f"model.layers.{i}.{block}.{short}"
                mapped = list(map_weight(f"{hf}.weight", torch.empty(0)))
                if len(mapped) != 1:
                    continue
                name, shard, _ = mapped[0]
                path = name.removesuffix(".weight")
                try:
                    linear = model.get_submodule(path)
                except AttributeError:
                    continue
                if not isinstance(linear, LinearBase):
                    continue
                part = linear._shard_index(shard) if isinstance(linear, MergedLinear) and shard is not None else 0
                targets[hf] = Target(path, part)
    if not targets:
        raise EngineConfigError(
            f"{type(model).__name__} has no q/k/v/o/gate/up/down projections LoRA adapters attach to "
            "(model.layers.N.self_attn.*_proj, mlp.*_proj): serve it without adapters")
    return targets


class LoRAManager:
    """Registered adapters and the device slot pool of one rank's model."""

    def __init__(self, model: nn.Module, num_layers: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, download_dir: str | None = None) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.download_dir = download_dir  # where adapters named by hub id are fetched to
        # The slots' rank: the limit rounded up to the kernels' step (the padding is zeros).
        self.pool_rank = -(-max_rank // _RANK_STEP) * _RANK_STEP
        self.device = device
        self.targets = target_linears(model, num_layers)
        self.slots: dict[str, LoRASlots] = {}
        for path in sorted({t.linear for t in self.targets.values()}):
            linear = model.get_submodule(path)
            linear.lora = self.slots[path] = LoRASlots(linear, num_slots, self.pool_rank, dtype, device)
        self.adapters: dict[int, Adapter] = {}
        self.by_name: dict[str, int] = {}
        self._last_id = 0  # ids only grow: the prefix cache keys blocks by them
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free = list(range(num_slots))
        logger.info("LoRA pool: %d slots of rank %d on %d linears (%.1f MiB)", num_slots, self.pool_rank,
                    len(self.slots), self.device_bytes() / 2**20)

    def device_bytes(self) -> int:
        """Bytes the slots take on the device."""
        return sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size() for s in self.slots.values())

    # ---- registering ------------------------------------------------------------------------

    def register(self, adapter_id: int, name: str, path: str, lora: PeftLoRA | None = None) -> Adapter:
        """Read (unless ``lora`` is given), check and keep adapter ``name`` under ``adapter_id``;
        raises AdapterError naming what does not fit the base model or the pool."""
        if name in self.by_name:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded: unload it first or pick another name")
        lora = read_peft_lora(path, download_dir=self.download_dir) if lora is None else lora
        if lora.rank > self.max_rank:
            raise AdapterError(f"adapter {name!r} ({path}) has rank {lora.rank}, over the pool's max_lora_rank "
                               f"{self.max_rank}: start the engine with max_lora_rank >= {lora.rank} "
                               f"(--max-lora-rank {lora.rank})")
        grouped: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in lora.modules.items():
            target = self.targets.get(module)
            if target is None:
                raise AdapterError(f"adapter {name!r} ({path}) targets {module}, which this base model does not "
                                   "have (was it trained on another model?)")
            slots = self.slots[target.linear]
            want_in, want_out = slots.full_in, slots.full_part_sizes[target.part]
            if tuple(weights.a.shape[1:]) != (want_in,) or weights.b.shape[0] != want_out:
                raise AdapterError(
                    f"adapter {name!r} ({path}): {module} is {weights.b.shape[0]} x {weights.a.shape[1]} "
                    f"(out x in) but the base model's is {want_out} x {want_in}: it was trained on another model")
            grouped.setdefault(target.linear, {})[target.part] = (weights.a, weights.b)
        adapter = Adapter(adapter_id, name, str(path), lora.rank)
        pin = self.device.type == "cuda"
        for linear, parts in grouped.items():
            a, b = self.slots[linear].local_weights(parts)
            adapter.weights[linear] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        self.adapters[adapter_id] = adapter
        self.by_name[name] = adapter_id
        self._last_id = max(self._last_id, adapter_id)
        return adapter

    def new_id(self) -> int:
        """An id no adapter of this engine has had."""
        return self._last_id + 1

    def unregister(self, name: str) -> Adapter | None:
        """Forget ``name`` (new requests can no longer name it); its weights stay until
        ``unused`` finds no sequence running with them. None when no adapter has that name."""
        adapter_id = self.by_name.pop(name, None)
        if adapter_id is None:
            return None
        adapter = self.adapters[adapter_id]
        adapter.live = False
        return adapter

    def unused(self, in_use: set[int]) -> list[int]:
        """Unloaded adapters no sequence in ``in_use`` (ids) runs with: their weights can go."""
        return [i for i, a in self.adapters.items() if not a.live and i not in in_use]

    def forget(self, adapter_id: int) -> None:
        """Drop an adapter's weights and free its slot."""
        self.adapters.pop(adapter_id, None)
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def names(self) -> list[str]:
        """Registered (live) adapter names, in load order."""
        return list(self.by_name)

    # ---- paging -----------------------------------------------------------------------------

    def slots_for(self, adapter_ids: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Each id's slot (-1 for 0, the base model), paging in the ones not resident; returns
        the slots and the (adapter id, slot) loads to apply (``apply_loads``) before the step."""
        needed = {i for i in adapter_ids if i}
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a step needs {len(needed)} adapters but the pool has {self.num_slots} slots "
                               "(the scheduler admits at most that many)")
        loads = []
        for adapter_id in needed:
            if adapter_id in self._slot_of:
                self._slot_of.move_to_end(adapter_id)
                continue
            if self._free:
                slot = self._free.pop()
            else:  # the least recently used adapter this step does not run
                victim = next(i for i in self._slot_of if i not in needed)
                slot = self._slot_of.pop(victim)
            self._slot_of[adapter_id] = slot
            loads.append((adapter_id, slot))
        return [self._slot_of[i] if i else -1 for i in adapter_ids], loads

    def apply_loads(self, loads: list[tuple[int, int]]) -> None:
        """Copy each (adapter, slot) of ``loads`` into the slot (queued on the device's stream)."""
        for adapter_id, slot in loads:
            adapter = self.adapters[adapter_id]
            for linear, slots in self.slots.items():
                weights = adapter.weights.get(linear)
                if weights is None:  # a linear it does not target: zeros
                    slots.a[slot].zero_()
                    slots.b[slot].zero_()
                else:
                    slots.load(slot, *weights)
