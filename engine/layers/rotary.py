"""Rotary position embedding: a float32 ``cos_sin_cache`` computed like transformers' RoPE.

The inverse frequencies follow ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` op for
op (same dtypes, same order) so cached cos/sin equal Hugging Face's bit for bit for default,
linear, llama3 and yarn scaling.

Dynamic NTK is the one type a static table cannot reproduce in general: Hugging Face picks the
base from the *current* sequence length. Row ``p`` here uses the base for length ``p + 1`` (and
the unscaled base up to ``max_position_embeddings``). That equals Hugging Face for every token
up to ``max_position_embeddings`` and for tokens decoded one at a time past it; a single prefill
longer than ``max_position_embeddings`` differs slightly (HF uses one base for the whole prompt).
LMDeploy's ``rope_scaling_factor`` engine setting maps to this type.

LongRoPE (Phi-3's 128k models; ``su`` in older configs) has the same kind of switch: Hugging Face
rotates with the ``short_factor`` frequencies while the sequence fits the pretraining length
(``original_max_position_embeddings``) and with ``long_factor`` once it is longer. Rows below that
length here use the short frequencies and rows past it the long ones: equal to Hugging Face for
every sequence that fits, and for tokens decoded one at a time past it (its cached keys keep the
rotation they got); a single prefill longer than the pretraining length differs (HF rotates all
of it with the long frequencies).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su")


def _base_inv_freq(base: float, dim: int, device: torch.device | None = None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _llama3_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope_cos_sin_cache(
    base: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int, max_position: int
) -> torch.Tensor:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def table(ext_factors: list[float], start: int, stop: int) -> torch.Tensor:
        if len(ext_factors) != dim // 2:
            raise UnsupportedModelError(f"longrope factors have {len(ext_factors)} entries; head_dim {dim} "
                                        f"needs {dim // 2}")
        inv_freq = 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base**exponents)
        return torch.arange(start, stop, dtype=torch.int64).float()[:, None] * inv_freq[None, :]

    within = min(max_position, original)
    freqs = torch.cat([table(scaling["short_factor"], 0, within), table(scaling["long_factor"], within, max_position)])
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def compute_cos_sin_cache(
    head_dim: int,
    base: float,
    max_position_embeddings: int,
    rope_scaling: dict[str, Any] | None,
    max_position: int,
) -> torch.Tensor:
    """``[max_position, head_dim]`` float32 = ``cat(cos, sin)`` of the half-dim angles, on CPU."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    dim = head_dim
    attention_factor = 1.0
    positions = torch.arange(max_position, dtype=torch.int64).float()
    if rope_type == "default":
        inv_freq = _base_inv_freq(base, dim)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(base, dim) / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(base, dim, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base, dim, scaling, max_position_embeddings)
    elif rope_type == "dynamic":
        return _dynamic_cos_sin_cache(base, dim, float(scaling["factor"]), max_position_embeddings, max_position)
    elif rope_type in ("longrope", "su"):
        return _longrope_cos_sin_cache(base, dim, scaling, max_position_embeddings, max_position)
    else:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def _dynamic_cos_sin_cache(
    base: float, dim: int, factor: float, max_position_embeddings: int, max_position: int
) -> torch.Tensor:
    # Row p rotates with the NTK base Hugging Face picks for a sequence of length max(p+1, max_pos).
    within = min(max_position, max_position_embeddings)
    freqs = torch.arange(within, dtype=torch.int64).float()[:, None] * _base_inv_freq(base, dim)[None, :]
    if max_position > within:
        pos = torch.arange(within, max_position, dtype=torch.float64)
        scaled_base = base * ((factor * (pos + 1) / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        inv_freq = 1.0 / (scaled_base.to(torch.float32)[:, None] ** exponents[None, :])
        freqs = torch.cat([freqs, pos.to(torch.float32)[:, None] * inv_freq], dim=0)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def default_max_position(max_position_embeddings: int, rope_scaling: dict[str, Any] | None) -> int:
    """How many positions the cache covers: the context the scaling is meant to reach."""
    if not rope_scaling:
        return max_position_embeddings
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    factor = float(rope_scaling.get("factor") or 1.0)
    if rope_type in ("linear", "dynamic"):
        return int(max_position_embeddings * factor)
    if rope_type == "yarn":
        original = rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
        return max(max_position_embeddings, int(original * factor))
    return max_position_embeddings


class RotaryEmbedding(nn.Module):
    """Holds RoPE's precomputed float32 ``cos_sin_cache`` ``[max_position, R]`` (R: the rotated
    dims, ``rotary_dim``, ``head_dim`` unless set).

    Two layouts of the rotated dims:

    * the whole head, halves paired (``x[i]`` with ``x[i + D/2]``: Llama's ``rotate_half``):
      ``fused``; the attention layer rotates q and k with the cache in the kernel that stores the
      keys (``rotate_and_store_kv``);
    * anything else: only the first ``rotary_dim`` dims of each head rotated (partial rotary:
      GLM, ChatGLM, Phi-4-mini; none at all for ``rotary_dim`` 0, the models whose positions
      enter through ALiBi instead), and/or adjacent dims paired (``x[2i]`` with ``x[2i+1]``:
      ``interleaved``, GLM and ChatGLM). ``forward`` rotates q and k here in torch and the
      attention layer stores the rotated keys as they are. Teaching the store kernel a rotary
      width and the pairing is the faster path for later (one pass over q and k, not three).

    The cache stays float32 whatever dtype the model is cast to: a cast recomputes it.

    ``mrope_section`` makes it Qwen2-VL's multimodal rotary (M-RoPE): each token has three
    positions (temporal, row, column; equal for text), and the rotated pairs are split into three
    runs of ``mrope_section`` pairs, each rotated by one of them. A step whose tokens all have
    equal positions rotates as plain RoPE; one with image tokens goes through ``at``.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        max_position: int | None = None,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        mrope_section: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim  # 0: no rotation (ALiBi models)
        if self.rotary_dim > head_dim or self.rotary_dim % 2:
            raise UnsupportedModelError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {head_dim}")
        self.interleaved = interleaved
        self.base = base
        self.max_position_embeddings = max_position_embeddings
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.max_position = max_position or default_max_position(max_position_embeddings, self.rope_scaling)
        self.register_buffer("cos_sin_cache", self._compute(), persistent=False)
        self.mrope_section = list(mrope_section) if mrope_section else None
        if self.mrope_section and (sum(self.mrope_section) * 2 != self.rotary_dim or interleaved):
            raise UnsupportedModelError(f"mrope_section {self.mrope_section} must split the {self.rotary_dim // 2} "
                                        "rotated pairs of each head (halves paired)")

    @contextmanager
    def at(self, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """M-RoPE for one forward: ``positions`` ``[3, T]`` (temporal, row, column). Inside, the
        table is the step's own ``[T, R]`` rows (each pair's cos and sin taken at its section's
        position) and the yielded ``[T]`` positions index them, so the attention layers and
        kernels rotate as they always do."""
        cache = self.cos_sin_cache
        section = torch.repeat_interleave(torch.arange(3, device=cache.device),
                                          torch.tensor(self.mrope_section, device=cache.device))
        pick = torch.cat([section, section])  # the cos half, then the sin half
        rows = cache[positions]  # [3, T, R]
        table = rows.gather(0, pick.expand(1, rows.shape[1], -1)).squeeze(0)
        self.cos_sin_cache = table
        try:
            yield torch.arange(positions.shape[1], device=positions.device)
        finally:
            self.cos_sin_cache = cache

    def _compute(self, device: torch.device | None = None) -> torch.Tensor:
        cache = compute_cos_sin_cache(
            self.rotary_dim, self.base, self.max_position_embeddings, self.rope_scaling, self.max_position
        )
        return cache.to(device) if device is not None else cache

    @property
    def fused(self) -> bool:
        """Whether the attention kernels can rotate with this table (whole head, halves paired)."""
        return self.rotary_dim == self.head_dim and not self.interleaved

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k ``[T, Hkv, D]`` rotated at ``positions`` ``[T]`` (new tensors; the
        dims past ``rotary_dim`` pass through). Computed in float32, returned in q's dtype."""
        if self.rotary_dim == 0:
            return q, k
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, R/2] each
        cos, sin = cos[:, None, :], sin[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot = x[..., :r].float()
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.stack((o1, o2), dim=-1).flatten(-2) if self.interleaved else torch.cat((o1, o2), dim=-1)
        return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1) if r < x.shape[-1] else out.to(x.dtype)

    def _apply(self, fn, recurse: bool = True):  # nn.Module's signature
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            # A cast (model.half() etc.) must not lose the table's precision: rebuild it.
            self.cos_sin_cache = self._compute(self.cos_sin_cache.device)
        return self


def rope_scaling_for(
    config_scaling: dict[str, Any] | None, rope_scaling_factor: float = 0.0
) -> dict[str, Any] | None:
    """The scaling to use: the config's, else dynamic NTK when ``rope_scaling_factor > 0`` (LMDeploy)."""
    if config_scaling and config_scaling.get("rope_type", config_scaling.get("type", "default")) != "default":
        if rope_scaling_factor > 0:
            logger.warning("rope_scaling_factor=%s ignored: the model config already sets rope scaling %s",
                           rope_scaling_factor, config_scaling)
        return dict(config_scaling)
    if rope_scaling_factor > 0:
        return {"rope_type": "dynamic", "factor": float(rope_scaling_factor)}
    return None


def partial_rotary_factor(config: Any, default: float = 1.0) -> float:
    """The share of ``head_dim`` a config rotates: ``partial_rotary_factor`` at top level (older
    configs) or in ``rope_parameters`` (transformers 5); ``default`` if neither says."""
    raw = getattr(config, "raw", {}) or {}
    params = raw.get("rope_parameters") or {}
    value = raw.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    return float(default if value is None else value)


def get_rope(
    config: Any, rope_scaling_factor: float = 0.0, max_position: int | None = None,
    partial_rotary_factor: float = 1.0, interleaved: bool = False, mrope_section: list[int] | None = None,
) -> RotaryEmbedding:
    """Build the RotaryEmbedding a ``ModelConfig`` describes. The family says which share of each
    head rotates (``partial_rotary_factor``: transformers' ``int(head_dim * factor)`` dims) and
    whether adjacent dims pair (``interleaved``); a config asking for a partial rotary the family
    does not apply is refused."""
    scaling = rope_scaling_for(config.rope_scaling, rope_scaling_factor)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        if float(scaling.pop("partial_rotary_factor", partial_rotary_factor)) != partial_rotary_factor:
            raise UnsupportedModelError(
                f"partial rotary embeddings (partial_rotary_factor < 1) are not supported for "
                f"{getattr(config, 'architecture', 'this model')}"
            )
        if rope_type in ("llama3", "yarn", "longrope", "su"):
            # Some configs (Phi-3 style) keep the pretraining length at top level; HF prefers it.
            raw = getattr(config, "raw", {}) or {}
            original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = original or config.max_position_embeddings
    return RotaryEmbedding(
        config.head_dim, config.max_position_embeddings, config.rope_theta, scaling, max_position,
        rotary_dim=int(config.head_dim * partial_rotary_factor), interleaved=interleaved,
        mrope_section=mrope_section,
    )
