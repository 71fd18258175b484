"""The settings of a weight-only AWQ run, checked before any work starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ...protocol.errors import ConveyorError

SUPPORTED_BITS = (4,)
# Group sizes the W4A16 GEMM kernels handle; each must divide every quantized layer's input size.
SUPPORTED_GROUP_SIZES = (32, 64, 128)
PACK_FACTOR = 8  # 4-bit values per int32


class QuantizationError(ConveyorError, ValueError):
    """A quantization setting is invalid or does not fit the model; the message names the fix."""


@dataclass
class AwqConfig:
    """What ``auto_awq`` does: LMDeploy's ``lite auto_awq`` options plus the search's own knobs.

    ``search_scale=False`` is plain round-to-nearest (no activation-aware scales, no clipping),
    the baseline AWQ is measured against. ``duo_scaling`` searches ``mean|x|**a / mean|w|**(1-a)``
    (AutoAWQ's default and LMDeploy's form) instead of the paper's ``mean|x|**a``.
    ``search_tokens`` bounds the calibration tokens the scale search re-runs blocks on and
    ``clip_tokens`` those of the clip search (the activation statistics use every token).
    ``propagate`` picks the next layer's calibration input: ``"quantized"`` the quantized
    layer's output (as GPTQ does; one more forward pass per layer), ``"fp"`` the unquantized
    layer's output (what AutoAWQ and LMDeploy do). Measured on a calibration split of the
    shipped text (SmolLM2-135M, g64), the defaults scored best; paper scales, fp propagation,
    float32 compute or no clipping scored up to 2.3 % higher perplexity, about the spread
    between otherwise equal runs.
    """

    w_bits: int = 4
    w_group_size: int = 128
    search_scale: bool = True
    apply_clip: bool | None = None  # None: with search_scale
    calib_samples: int = 128
    calib_seqlen: int = 512
    batch_size: int = 1
    n_grid: int = 20
    duo_scaling: bool = True
    search_tokens: int = 4096
    clip_tokens: int = 512
    propagate: Literal["fp", "quantized"] = "quantized"

    def __post_init__(self) -> None:
        if self.w_bits not in SUPPORTED_BITS:
            raise QuantizationError(
                f"--w-bits {self.w_bits} is not supported: the AWQ 'gemm' format packs 4-bit weights; use --w-bits 4")
        if self.w_group_size not in SUPPORTED_GROUP_SIZES:
            raise QuantizationError(
                f"--w-group-size {self.w_group_size} is not supported: use one of "
                f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (the W4A16 kernels' group sizes)")
        for name in ("calib_samples", "calib_seqlen", "batch_size", "n_grid", "search_tokens", "clip_tokens"):
            if getattr(self, name) < 1:
                raise QuantizationError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.calib_seqlen < 2:
            raise QuantizationError("--calib-seqlen must be at least 2 tokens")
        if self.propagate not in ("fp", "quantized"):
            raise QuantizationError(f"propagate must be 'fp' or 'quantized', got {self.propagate!r}")
        if self.apply_clip is None:
            self.apply_clip = self.search_scale

    def check_model(self, hf_config: dict[str, Any]) -> None:
        """Raise if the group size does not divide an input size of the model's linear layers."""
        hidden = hf_config["hidden_size"]
        heads = hf_config["num_attention_heads"]
        kv_heads = hf_config.get("num_key_value_heads") or heads
        head_dim = hf_config.get("head_dim") or hidden // heads
        inter = hf_config["intermediate_size"]
        inputs = {"hidden_size (q/k/v, gate/up)": hidden, "attention output (o_proj)": heads * head_dim,
                  "intermediate_size (down_proj)": inter}
        outputs = {"q_proj": heads * head_dim, "k/v_proj": kv_heads * head_dim, "o_proj": hidden,
                   "gate/up_proj": inter}
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # Qwen MoE experts' widths
            if hf_config.get(key):
                inputs[f"{key} (down_proj)"] = outputs[f"{key} (gate/up_proj)"] = hf_config[key]
        bad = {what: size for what, size in inputs.items() if size % self.w_group_size}
        if bad:
            fits = [g for g in SUPPORTED_GROUP_SIZES if all(size % g == 0 for size in inputs.values())]
            what, size = next(iter(bad.items()))
            fix = (f"use --w-group-size {' or '.join(map(str, sorted(fits, reverse=True)))}" if fits
                   else "no supported group size fits this model")
            raise QuantizationError(
                f"--w-group-size {self.w_group_size} does not divide the model's {what} of {size} "
                f"({size / self.w_group_size:g} groups): {fix}")
        odd = {name: size for name, size in outputs.items() if size % PACK_FACTOR}
        if odd:
            raise QuantizationError(
                f"the AWQ format packs {PACK_FACTOR} output channels per int32, but {odd} are not multiples of "
                f"{PACK_FACTOR}: this model cannot be stored in the 'gemm' layout")


W8A8_BITS = (8,)


@dataclass
class SmoothQuantConfig:
    """What ``smooth_quant`` does: LMDeploy's ``lite smooth_quant`` options.

    ``alpha`` is SmoothQuant's migration strength: each input channel ``j`` of a group of linears
    is scaled by ``s_j = max|x_j|**alpha / max|w_j|**(1 - alpha)`` (activations divided, weights
    multiplied), moving that much of the activation outliers' range into the weights.
    ``smooth=False`` quantizes the weights to int8 as they are and runs no calibration (the
    baseline smoothing is measured against).
    """

    w_bits: int = 8
    alpha: float = 0.5
    smooth: bool = True
    calib_samples: int = 128
    calib_seqlen: int = 512
    batch_size: int = 1

    def __post_init__(self) -> None:
        if self.w_bits not in W8A8_BITS:
            raise QuantizationError(
                f"--w-bits {self.w_bits} is not supported: SmoothQuant writes int8 weights (W8A8); use --w-bits 8, "
                "or `conveyor lite auto_awq` for 4-bit weights")
        if not 0.0 <= self.alpha <= 1.0:
            raise QuantizationError(f"--alpha {self.alpha} must be between 0 and 1 (0.5 is SmoothQuant's default)")
        for name in ("calib_samples", "calib_seqlen", "batch_size"):
            if getattr(self, name) < 1:
                raise QuantizationError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.calib_seqlen < 2:
            raise QuantizationError("--calib-seqlen must be at least 2 tokens")
