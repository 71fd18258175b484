"""Which weight format a checkpoint holds, and the linear method that runs it.

Read from ``config.json``'s ``quantization_config`` (what AutoAWQ, ``conveyor lite auto_awq``
and llm-compressor write), or from ``EngineConfig.model_format`` when the config says nothing
(dummy weights for benchmarks). An explicit ``model_format`` that contradicts the checkpoint is
refused with the fix, never silently overridden. Embeddings, norms and the LM head stay in 16
bits whatever the format: only the decoder's linear layers are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..protocol.errors import EngineConfigError

AWQ_GROUP_SIZES = (32, 64, 128)
# InternLM2's checkpoints fuse q/k/v head by head (wqkv), which a packed AWQ tensor cannot be split by.
AWQ_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
DEFAULT_AWQ_GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantFormat:
    """A quantized weight format: ``method`` 'awq' (W4A16, group-wise asymmetric 4-bit)."""

    method: str
    bits: int = 4
    group_size: int = DEFAULT_AWQ_GROUP_SIZE

    @property
    def model_format(self) -> str:
        """The ``model_format`` name LMDeploy users pass for it."""
        return self.method

    def linear_method(self):
        """A fresh LinearMethod for one layer."""
        if self.method == "awq":
            from .layers.awq_linear import AWQLinearMethod

            return AWQLinearMethod(self.group_size)
        raise EngineConfigError(f"no linear method for {self.method!r}")

    def check_widths(self, widths: dict[str, int]) -> None:
        """Refuse a model whose linear inputs the group size cannot run (names the widths)."""
        if self.method != "awq":
            return
        odd = {what: k for what, k in widths.items() if k % 8}
        if odd:
            raise EngineConfigError(f"AWQ needs layer widths that are multiples of 8; this model has {odd}")


def _from_quantization_config(qc: dict[str, Any]) -> QuantFormat:
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
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
    raise EngineConfigError(
        f"config.json's quantization_config has quant_method={method!r}, which is not supported: "
        "use an AWQ checkpoint (AutoAWQ 'gemm' layout, or `conveyor lite auto_awq`) or an fp16/bf16 one")


def resolve_quant_format(model_config: Any, model_format: str | None,
                         dummy_weights: bool = False) -> QuantFormat | None:
    """The format to run ``model_config``'s checkpoint in: its own, checked against
    ``model_format`` (None/'hf': any) and against the model's shapes. With dummy weights there is
    no checkpoint: ``model_format`` alone decides."""
    fmt = _resolve(model_config.raw, model_format, dummy_weights)
    if fmt is not None:
        if model_config.architecture not in AWQ_ARCHITECTURES:
            raise EngineConfigError(f"AWQ weights are read for {sorted(AWQ_ARCHITECTURES)}, not "
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
    if model_format == "awq":
        if not dummy_weights:
            raise EngineConfigError(
                "model_format='awq' but config.json has no quantization_config, so these are not AWQ "
                "weights: quantize the model with `conveyor lite auto_awq MODEL --work-dir DIR` and serve DIR")
        return QuantFormat("awq")
    return None
