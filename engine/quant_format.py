"""Which weight format a checkpoint holds, and the linear method that runs it.

Read from ``config.json``'s ``quantization_config`` (what AutoAWQ, llm-compressor,
``conveyor lite auto_awq`` and ``conveyor lite smooth_quant`` write), or from
``EngineConfig.model_format`` when the config says nothing (dummy weights for benchmarks). An
explicit ``model_format`` that contradicts the checkpoint is refused with the fix, never silently
overridden. Embeddings, norms and the LM head stay in 16 bits whatever the format: only the
decoder's linear layers are quantized.

Two formats run:

* ``awq`` (W4A16): AutoAWQ's "gemm" layout, 4-bit group-wise asymmetric weights.
* ``smooth_quant`` (W8A8): compressed-tensors' "int-quantized" layout with int8 weights per
  output channel (symmetric) and int8 activations per token, quantized at run time (dynamic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..protocol.errors import EngineConfigError
from .weight_loader import materialize

AWQ_GROUP_SIZES = (32, 64, 128)
# The families whose AWQ / W8A8 checkpoints the engine reads: those the tools quantize
# (engine/quantization/layouts.py), with the unfused Llama projections. InternLM2's checkpoints fuse
# q/k/v head by head (wqkv), which a quantized tensor cannot be split by; the others are untested.
QUANT_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                 "InternLM3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                                 "Gemma3ForCausalLM"})
# Mixture-of-experts families whose AWQ and W8A8 checkpoints are read (experts:
# engine/layers/moe_awq.py, moe_w8a8.py). DBRX's fused Wqkv and DeepSeek-V2's MLA (absorbed through
# kv_b_proj's dense weight) and DeepSeek-MoE are not read quantized.
MOE_QUANT_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
DEFAULT_AWQ_GROUP_SIZE = 128
# model_format name -> QuantFormat.method
_METHOD_OF_FORMAT = {"awq": "awq", "smooth_quant": "w8a8"}
_TOOL_OF_FORMAT = {"awq": "conveyor lite auto_awq", "smooth_quant": "conveyor lite smooth_quant"}
# Checkpoint tensors of compressed-tensors' int8 layout that carry nothing for symmetric dynamic
# quantization; read only to check that they are indeed zero.
_ZERO_POINT_SUFFIX = ".weight_zero_point"


@dataclass(frozen=True)
class QuantFormat:
    """A quantized weight format: ``method`` 'awq' (W4A16, group-wise asymmetric 4-bit) or 'w8a8'
    (int8 weights per channel, int8 activations per token)."""

    method: str
    bits: int = 4
    group_size: int = DEFAULT_AWQ_GROUP_SIZE

    @property
    def model_format(self) -> str:
        """The ``model_format`` name LMDeploy users pass for it."""
        return "smooth_quant" if self.method == "w8a8" else self.method

    @property
    def takes_int8_input(self) -> bool:
        """Whether its linears read int8 activations (so the norms before them quantize their output)."""
        return self.method == "w8a8"

    def linear_method(self):
        """A fresh LinearMethod for one layer."""
        if self.method == "awq":
            from .layers.awq_linear import AWQLinearMethod

            return AWQLinearMethod(self.group_size)
        if self.method == "w8a8":
            from .layers.w8a8_linear import W8A8LinearMethod

            return W8A8LinearMethod()
        raise EngineConfigError(f"no linear method for {self.method!r}")

    def check_widths(self, widths: dict[str, int]) -> None:
        """Refuse a model whose linear inputs the format cannot run (names the widths)."""
        if self.method != "awq":
            return
        odd = {what: k for what, k in widths.items() if k % 8}
        if odd:
            raise EngineConfigError(f"AWQ needs layer widths that are multiples of 8; this model has {odd}")

    def skips_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether a checkpoint tensor holds nothing this format reads: compressed-tensors' all-zero
        weight zero points. A non-zero one (asymmetric weights) is refused."""
        if self.method != "w8a8" or not name.endswith(_ZERO_POINT_SUFFIX):
            return False
        if torch.count_nonzero(materialize(tensor)):
            raise EngineConfigError(f"{name} has non-zero zero points (asymmetric int8 weights); only symmetric "
                                    "W8A8 weights run here: re-quantize with `conveyor lite smooth_quant`")
        return True


def _from_awq_config(qc: dict[str, Any]) -> QuantFormat:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", DEFAULT_AWQ_GROUP_SIZE)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise EngineConfigError(f"this AWQ checkpoint has {bits}-bit weights; only 4-bit AWQ runs here")
    if version != "gemm":
        raise EngineConfigError(f"this AWQ checkpoint uses the {version!r} layout; only AutoAWQ's 'gemm' "
                                "layout is read (re-export it with version='gemm', or run conveyor lite auto_awq)")
    if not qc.get("zero_point", True):
        raise EngineConfigError("this AWQ checkpoint has no zero points (symmetric); only zero_point=true is read")
    if group not in AWQ_GROUP_SIZES and group != -1:
        raise EngineConfigError(f"AWQ group_size {group}: use one of {AWQ_GROUP_SIZES}")
    return QuantFormat("awq", bits, group)


_LEFT_16_BIT = re.compile(r"(lm_head|\.gate|shared_expert_gate)\$?$")
_W8A8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_W8A8_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def _from_compressed_tensors(qc: dict[str, Any]) -> QuantFormat:
    """compressed-tensors' W8A8 int8 scheme (weights per channel, dynamic per-token activations)."""
    fix = ("only W8A8 int8 (symmetric per-channel weights, dynamic per-token activations) is read from "
           "compressed-tensors checkpoints: quantize the fp16/bf16 model with `conveyor lite smooth_quant`")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise EngineConfigError(f"this compressed-tensors checkpoint has no config_groups; {fix}")
    for group in groups:
        fmt = group.get("format", qc.get("format"))
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        wrong = {f"weights.{k}": weights.get(k) for k, v in _W8A8_WEIGHTS.items() if weights.get(k) != v}
        wrong |= {f"input_activations.{k}": inputs.get(k) for k, v in _W8A8_INPUTS.items() if inputs.get(k) != v}
        if fmt not in (None, "int-quantized"):
            wrong["format"] = fmt
        if "Linear" not in (group.get("targets") or []):
            wrong["targets"] = group.get("targets")
        if wrong:
            raise EngineConfigError(f"this compressed-tensors checkpoint has {wrong}; {fix}")
    # The LM head stays 16-bit in every format, and so do the routers and Qwen2-MoE's shared-expert
    # gate (``mlp.gate``, ``block_sparse_moe.gate``, ``shared_expert_gate``; llm-compressor lists
    # them, often as ``re:.*mlp.gate$``), which the engine never quantizes.
    kept = [name for name in qc.get("ignore") or [] if not _LEFT_16_BIT.search(str(name))]
    if kept:
        raise EngineConfigError(f"this checkpoint leaves {kept[:3]} unquantized; W8A8 runs here with every decoder "
                                "linear quantized: re-quantize with `conveyor lite smooth_quant`")
    return QuantFormat("w8a8", 8, -1)


def _from_quantization_config(qc: dict[str, Any]) -> QuantFormat:
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _from_awq_config(qc)
    if method == "compressed-tensors":
        return _from_compressed_tensors(qc)
    raise EngineConfigError(
        f"config.json's quantization_config has quant_method={method!r}, which is not supported: use an AWQ "
        "checkpoint (AutoAWQ 'gemm' layout, or `conveyor lite auto_awq`), a W8A8 one (compressed-tensors int8, "
        "or `conveyor lite smooth_quant`) or an fp16/bf16 one")


def resolve_quant_format(model_config: Any, model_format: str | None,
                         dummy_weights: bool = False) -> QuantFormat | None:
    """The format to run ``model_config``'s checkpoint in: its own, checked against
    ``model_format`` (None/'hf': any) and against the model's shapes. With dummy weights there is
    no checkpoint: ``model_format`` alone decides."""
    fmt = _resolve(model_config.raw, model_format, dummy_weights)
    if fmt is not None:
        if model_config.architecture not in QUANT_ARCHITECTURES | MOE_QUANT_ARCHITECTURES:
            raise EngineConfigError(f"{fmt.model_format} weights are read for "
                                    f"{sorted(QUANT_ARCHITECTURES | MOE_QUANT_ARCHITECTURES)}, not "
                                    f"{model_config.architecture}: serve its fp16/bf16 checkpoint")
        d = model_config.head_dim
        fmt.check_widths({"hidden_size": model_config.hidden_size,
                          "intermediate_size": model_config.intermediate_size,
                          "q/o width": model_config.num_heads * d, "k/v width": model_config.num_kv_heads * d})
    return fmt


def _resolve(raw_config: dict[str, Any], model_format: str | None, dummy_weights: bool) -> QuantFormat | None:
    qc = raw_config.get("quantization_config")
    found = _from_quantization_config(qc) if qc else None
    if found is not None:
        if model_format not in (None, "hf", found.model_format):
            raise EngineConfigError(
                f"model_format={model_format!r} but this checkpoint is {found.model_format!r} "
                f"(config.json's quantization_config): pass model_format={found.model_format!r} or None")
        return found
    method = _METHOD_OF_FORMAT.get(model_format or "")
    if method is None:
        return None
    if not dummy_weights:
        raise EngineConfigError(
            f"model_format={model_format!r} but config.json has no quantization_config, so these are not "
            f"{model_format} weights: quantize the model with `{_TOOL_OF_FORMAT[model_format]} MODEL --work-dir DIR` "
            "and serve DIR")
    return QuantFormat("awq") if method == "awq" else QuantFormat("w8a8", 8, -1)
