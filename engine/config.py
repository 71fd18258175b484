"""The engine's settings: one ``EngineConfig`` that also answers to LMDeploy's two config names."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from conveyor.engine.errors import EngineConfigError

logger = logging.getLogger(__name__)

_QUANT_POLICIES = (0, 4, 8)
_MODEL_FORMATS = (None, "hf", "llama", "gguf", "awq", "smooth_quant")
# LMDeploy fields that are accepted so scripts run unchanged, but change nothing here.
_ACCEPTED_NO_EFFECT = (
    "model_name", "download_dir", "revision", "use_logn_attn", "num_tokens_per_iter",
    "max_prefill_iters", "eviction_type", "prefill_interval", "num_cpu_blocks", "adapters",
    "thread_safe", "shared_cache",
)


@dataclass
class EngineConfig:
    """How the engine runs a model.

    ``cache_max_entry_count`` sizes the KV cache: a float in (0, 1] is a fraction of the free
    device memory after the weights are loaded (LMDeploy's meaning); an int is a number of
    blocks; a float above 1 or a string like ``"4GiB"`` is an absolute size.
    ``cache_block_seq_len`` (TurboMind's name) and ``num_gpu_blocks`` (the PyTorch engine's)
    are accepted and mapped onto ``block_size`` and ``cache_max_entry_count``.
    """

    tp: int = 1
    session_len: int | None = None
    max_batch_size: int = 128
    cache_max_entry_count: float | int | str = 0.8
    block_size: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    max_prefill_token_num: int = 8192
    model_format: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # "auto": read the checkpoint; "dummy": seeded random weights built on the device, no weight
    # files read (vLLM's name; for benchmarks of a model shape whose weights are not at hand).
    load_format: str = "auto"
    # Schedule and queue step N+1 while the GPU runs step N (engine/llm_engine.py); False reads
    # every step back before the next (the environment's CONVEYOR_OVERLAP=0 does the same).
    # None: on for CUDA; off on the CPU, where a "launch" computes the step at once, so the
    # overlap would only report every token one step later.
    overlap_schedule: bool | None = None
    # LMDeploy spellings, folded into the fields above.
    cache_block_seq_len: int | None = None
    num_gpu_blocks: int = 0
    # Accepted for compatibility; no effect (see _ACCEPTED_NO_EFFECT).
    model_name: str | None = None
    download_dir: str | None = None
    revision: str | None = None
    use_logn_attn: bool = False
    num_tokens_per_iter: int = 0
    max_prefill_iters: int = 1
    eviction_type: str = "recompute"
    prefill_interval: int = 16
    num_cpu_blocks: int = 0
    adapters: dict | None = None
    thread_safe: bool = False
    shared_cache: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.cache_block_seq_len is not None:
            self.block_size = self.cache_block_seq_len
        if self.num_gpu_blocks:
            self.cache_max_entry_count = int(self.num_gpu_blocks)
        if self.tp < 1:
            raise EngineConfigError(f"tp={self.tp}: must be >= 1 (number of GPUs for tensor parallel)")
        if self.tp > 1:
            raise EngineConfigError(f"tp={self.tp}: tensor parallel is not implemented yet; use tp=1")
        if self.max_batch_size < 1:
            raise EngineConfigError(f"max_batch_size={self.max_batch_size}: must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise EngineConfigError(f"block_size={self.block_size}: use a power of two such as 16, 32 or 64")
        if self.session_len is not None and self.session_len < 2:
            raise EngineConfigError(f"session_len={self.session_len}: must be >= 2, or None for the model's maximum")
        if self.max_prefill_token_num < 1:
            raise EngineConfigError(f"max_prefill_token_num={self.max_prefill_token_num}: must be >= 1")
        if self.quant_policy not in _QUANT_POLICIES:
            raise EngineConfigError(f"quant_policy={self.quant_policy}: use 0 (none), 4 (int4 KV) or 8 (int8 KV)")
        if self.quant_policy:
            raise EngineConfigError("quantized KV cache (quant_policy 4/8) is not implemented yet; use quant_policy=0")
        if self.model_format not in _MODEL_FORMATS:
            raise EngineConfigError(f"model_format={self.model_format!r}: use one of {_MODEL_FORMATS}")
        if self.overlap_schedule not in (None, True, False):
            raise EngineConfigError(
                f"overlap_schedule={self.overlap_schedule!r}: use True, False or None (on for CUDA only)")
        if self.load_format not in ("auto", "dummy"):
            raise EngineConfigError(f"load_format={self.load_format!r}: use 'auto' (read the weights) or 'dummy'")
        if self.rope_scaling_factor < 0:
            raise EngineConfigError(f"rope_scaling_factor={self.rope_scaling_factor}: must be >= 0 (0 disables)")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"):
            raise EngineConfigError(f"dtype={self.dtype!r}: use auto, float32, float16 or bfloat16")
        self.cache_bytes_or_blocks()  # validates cache_max_entry_count

    def cache_bytes_or_blocks(self) -> tuple[str, float]:
        """Classify cache_max_entry_count: ('fraction', f), ('blocks', n) or ('bytes', b)."""
        value = self.cache_max_entry_count
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            for suffix, scale in (("gib", 2**30), ("gb", 2**30), ("g", 2**30), ("mib", 2**20), ("mb", 2**20)):
                if text.endswith(suffix):
                    try:
                        return "bytes", float(text[: -len(suffix)]) * scale
                    except ValueError:
                        break
            raise EngineConfigError(f"cache_max_entry_count={value!r}: write a size like '4GiB' or '512MiB'")
        if isinstance(value, bool) or value <= 0:
            raise EngineConfigError(f"cache_max_entry_count={value!r}: must be > 0")
        if isinstance(value, int):
            return "blocks", value
        if value <= 1.0:
            return "fraction", float(value)
        return "bytes", float(value) * 2**30


# LMDeploy users import these names; they are the same config here.
TurbomindEngineConfig = EngineConfig
PytorchEngineConfig = EngineConfig
