"""The engine's settings: one ``EngineConfig`` that also answers to LMDeploy's two config names."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..protocol.errors import EngineConfigError

logger = logging.getLogger(__name__)

_QUANT_POLICIES = (0, 4, 8)  # kernels.kv_layout.QUANT_POLICIES (this module stays torch-free)
_MODEL_FORMATS = (None, "hf", "llama", "gguf", "awq", "smooth_quant")
_EVICTION_TYPES = ("recompute", "copy")
_DEFAULT_PREFILL_TOKENS = 8192
# Tensor parallel's paths for decode-sized all-reduces (engine/peer_all_reduce.py reads this tuple).
TP_ALL_REDUCE_KINDS = ("nccl", "one_shot", "two_shot", "fused")
KERNEL_MODES = ("auto", "ref", "triton")  # = kernels._triton.KERNEL_MODES (a test checks): this module stays torch-free


@dataclass
class EngineConfig:
    """How the engine runs a model.

    ``cache_max_entry_count`` sizes the KV cache: a float in (0, 1] is a fraction of the free
    device memory after the weights are loaded (LMDeploy's meaning); an int is a number of
    blocks; a float above 1 or a string like ``"4GiB"`` is an absolute size.
    ``cache_block_seq_len`` (TurboMind's name) and ``num_gpu_blocks`` (the PyTorch engine's)
    are accepted and mapped onto ``block_size`` and ``cache_max_entry_count``;
    ``num_tokens_per_iter`` (TurboMind's per-forward token count), when > 0, onto
    ``max_prefill_token_num``.

    Every other LMDeploy field keeps its name and default, and no value is silently ignored:
    one that asks for something not implemented (``eviction_type='copy'``, ``num_cpu_blocks``,
    ``use_logn_attn``, ``shared_cache``, quantized or Meta-layout
    ``model_format``) raises ``EngineConfigError`` naming what to use instead; one that only
    tunes something done differently here (``model_name``, ``max_prefill_iters``,
    ``prefill_interval``, ``thread_safe``, ``model_format='gguf'``) logs one warning saying so.
    ``revision`` and ``download_dir`` apply to hub ids (``resolve_model_path``).
    """

    tp: int = 1
    session_len: int | None = None
    max_batch_size: int = 128
    cache_max_entry_count: float | int | str = 0.8
    block_size: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    max_prefill_token_num: int = _DEFAULT_PREFILL_TOKENS
    # None or "hf": a Hugging Face checkpoint (a .gguf file is recognised by its suffix).
    model_format: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # "auto": read the checkpoint; "dummy": seeded random weights built on the device, no weight
    # files read (vLLM's name; for benchmarks of a model shape whose weights are not at hand).
    load_format: str = "auto"
    # Schedule and queue step N+1 while the GPU runs step N (engine/llm_engine.py); False reads
    # every step back before the next. None: on for CUDA; off on the CPU, where a "launch"
    # computes the step at once, so the overlap would only report every token one step later.
    overlap_schedule: bool | None = None
    # LMDeploy's PytorchEngineConfig name: True runs every step eagerly, without the decode CUDA
    # graphs (engine/cuda_graph.py). Off the GPU there are no graphs either way.
    eager_mode: bool = False
    # Which kernels run the model's layers (kernels/_triton.py), for the whole process: "auto"
    # the CUDA C++ kernels where one exists and cupy is installed (kernels/_cuda.py: W4A16 on
    # tensor cores), else Triton on CUDA tensors, and the torch references elsewhere; "ref" the torch references
    # everywhere; "triton" Triton everywhere (CPU tensors then need Triton's interpreter,
    # TRITON_INTERPRET=1), raising on inputs a kernel does not take instead of falling back.
    kernels: str = "auto"
    # Tensor parallel: how decode-sized all-reduces (up to 1 MiB) are summed. "nccl" (default) the
    # process group's all-reduce; "one_shot" / "two_shot" read the peer GPUs' memory directly
    # (engine/peer_all_reduce.py; CUDA, bfloat16 or float32, tp > 1); "fused" sums a Llama-style
    # layer's o_proj / down_proj parts by peer reads inside the kernel of the residual add and
    # RMSNorm after them (kernels/peer_norm.py; CUDA, any float dtype). Larger ones take NCCL.
    tp_all_reduce: str = "nccl"
    # Tensor parallel: seconds a rank's heartbeat may stay silent before it is taken for frozen and
    # every rank is stopped (engine/tp_workers.py).
    tp_hang_timeout: float = 30.0
    # Benchmarks: a directory where every tensor-parallel rank writes its per-step wait, host and
    # GPU times (rank<r>.json, engine/rank_timing.py) when the engine closes. None (default): no
    # step is timed and the ranks' step loops carry no timing code.
    rank_timing_dir: str | None = None
    # Seconds a parked interactive session (between turns) may wait for its next turn before its
    # KV blocks are freed. Its history stays as token ids, as when the cache runs short: a later
    # turn recomputes it (one prefill), ``end_session`` still works. Without it, sessions left
    # open hold their blocks forever. None or 0: keep them until the session ends or the cache
    # needs them.
    session_idle_timeout: float | None = 600.0
    # LMDeploy spellings, folded into the fields above.
    cache_block_seq_len: int | None = None
    num_gpu_blocks: int = 0
    # The other LMDeploy fields, with LMDeploy's defaults. No value is silently ignored: one
    # asking for something not implemented raises EngineConfigError, one that only tunes
    # something done differently here logs one warning (see __post_init__).
    model_name: str | None = None  # chat template: ChatTemplateConfig; served name: --model-name
    download_dir: str | None = None  # hub cache directory for hub ids (None: Hugging Face's)
    revision: str | None = None  # branch, tag or commit for hub ids
    use_logn_attn: bool = False  # not implemented
    num_tokens_per_iter: int = 0  # > 0: becomes max_prefill_token_num
    max_prefill_iters: int = 1  # no effect: prompts take as many chunks as they need
    eviction_type: str = "recompute"  # only "recompute"
    prefill_interval: int = 16  # no effect: prompts are admitted every step
    num_cpu_blocks: int = 0  # no CPU swap space
    # LoRA adapters (engine/lora/): {name: PEFT checkpoint directory} loaded at start. A request
    # picks one by name (SamplingParams.adapter_name). Their weights are paged into a pool of
    # ``max_loras`` slots of rank ``max_lora_rank`` on the device, least recently used out first;
    # a step mixes at most ``max_loras`` adapters. None: sized from the adapters given (one slot
    # each, at most 8; rank the largest of theirs, at least 16). LoRA is on when ``adapters`` is
    # given or ``max_loras`` is set (adapters may then be loaded at run time).
    adapters: dict[str, str] | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    thread_safe: bool = False  # no effect: the pipeline is always thread-safe
    shared_cache: bool = False  # not implemented

    def __post_init__(self) -> None:
        if self.cache_block_seq_len is not None:
            self.block_size = self.cache_block_seq_len
        if self.num_gpu_blocks:
            self.cache_max_entry_count = int(self.num_gpu_blocks)
        if self.num_tokens_per_iter < 0:
            raise EngineConfigError(
                f"num_tokens_per_iter={self.num_tokens_per_iter}: must be >= 0 "
                "(0 keeps max_prefill_token_num as the per-step token budget)")
        if self.num_tokens_per_iter:
            # TurboMind's tokens per forward pass: here, the step's token budget.
            if self.max_prefill_token_num not in (_DEFAULT_PREFILL_TOKENS, self.num_tokens_per_iter):
                raise EngineConfigError(
                    f"num_tokens_per_iter={self.num_tokens_per_iter} and max_prefill_token_num="
                    f"{self.max_prefill_token_num}: both set the tokens per step here; set only one")
            self.max_prefill_token_num = self.num_tokens_per_iter
        if self.tp < 1:
            raise EngineConfigError(f"tp={self.tp}: must be >= 1 (number of GPUs for tensor parallel)")
        if self.max_batch_size < 1:
            raise EngineConfigError(f"max_batch_size={self.max_batch_size}: must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise EngineConfigError(f"block_size={self.block_size}: use a power of two such as 16, 32 or 64")
        if self.session_len is not None and self.session_len < 2:
            raise EngineConfigError(f"session_len={self.session_len}: must be >= 2, or None for the model's maximum")
        if self.max_prefill_token_num < 1:
            raise EngineConfigError(f"max_prefill_token_num={self.max_prefill_token_num}: must be >= 1")
        if self.max_prefill_iters < 1:
            raise EngineConfigError(f"max_prefill_iters={self.max_prefill_iters}: must be >= 1 (default 1)")
        if self.prefill_interval < 1:
            raise EngineConfigError(f"prefill_interval={self.prefill_interval}: must be >= 1 (default 16)")
        if self.quant_policy not in _QUANT_POLICIES:
            raise EngineConfigError(f"quant_policy={self.quant_policy}: use 0 (none), 4 (int4 KV) or 8 (int8 KV)")
        self._check_model_format()
        if self.overlap_schedule not in (None, True, False):
            raise EngineConfigError(
                f"overlap_schedule={self.overlap_schedule!r}: use True, False or None (on for CUDA only)")
        self._check_session_idle_timeout()
        self._check_execution()
        if self.load_format not in ("auto", "dummy"):
            raise EngineConfigError(f"load_format={self.load_format!r}: use 'auto' (read the weights) or 'dummy'")
        if self.rope_scaling_factor < 0:
            raise EngineConfigError(f"rope_scaling_factor={self.rope_scaling_factor}: must be >= 0 (0 disables)")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"):
            raise EngineConfigError(f"dtype={self.dtype!r}: use auto, float32, float16 or bfloat16")
        self.cache_bytes_or_blocks()  # validates cache_max_entry_count
        self._check_hub_options()
        self._check_adapters()
        self._check_unimplemented()
        self._warn_no_effect()  # last: a config that is refused warns about nothing

    def _check_model_format(self) -> None:
        fmt = self.model_format
        if fmt not in _MODEL_FORMATS:
            raise EngineConfigError(
                f"model_format={fmt!r}: use None or 'hf' (a Hugging Face checkpoint or a .gguf file), "
                "'awq' (4-bit AWQ weights) or 'smooth_quant' (W8A8 int8 weights); None finds both")
        if fmt == "llama":
            raise EngineConfigError(
                "model_format='llama': Meta's original layout (consolidated.*.pth) is not read; convert "
                "it with transformers' convert_llama_weights_to_hf.py and pass that with model_format=None")

    def _check_session_idle_timeout(self) -> None:
        value = self.session_idle_timeout
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN != NaN
            raise EngineConfigError(
                f"session_idle_timeout={value!r}: give seconds as a number (e.g. 600), or None to "
                "keep idle sessions' KV blocks")
        if value < 0:
            raise EngineConfigError(
                f"session_idle_timeout={value}: must be >= 0 seconds (e.g. 600); 0 or None keeps idle "
                "sessions' KV blocks until the session ends or the cache needs them")

    def _check_execution(self) -> None:
        """How the steps run: graphs, kernels, tensor parallel's all-reduce and watchdog, timing."""
        if self.eager_mode not in (True, False):
            raise EngineConfigError(f"eager_mode={self.eager_mode!r}: use True (no CUDA graphs) or False")
        if self.kernels not in KERNEL_MODES:
            raise EngineConfigError(
                f"kernels={self.kernels!r}: use 'auto' (Triton on the GPU), 'ref' (the torch references) "
                "or 'triton' (Triton everywhere)")
        if self.tp_all_reduce not in TP_ALL_REDUCE_KINDS:
            raise EngineConfigError(
                f"tp_all_reduce={self.tp_all_reduce!r} is not one of {', '.join(TP_ALL_REDUCE_KINDS)}")
        value = self.tp_hang_timeout
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:  # NaN too
            raise EngineConfigError(
                f"tp_hang_timeout={value!r}: give the seconds a rank may stay silent as a number > 0 (default 30)")
        if self.rank_timing_dir is not None and (not isinstance(self.rank_timing_dir, str) or not self.rank_timing_dir):
            raise EngineConfigError(
                f"rank_timing_dir={self.rank_timing_dir!r}: name a directory, or None to time nothing")

    def _check_hub_options(self) -> None:
        for name in ("revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise EngineConfigError(f"{name}={value!r}: use a string, or None for the default")
        if self.revision == "":
            raise EngineConfigError("revision='': name a branch, tag or commit, or use None for the default")
        if self.download_dir == "":
            raise EngineConfigError("download_dir='': name a directory, or use None for Hugging Face's cache")

    def _check_adapters(self) -> None:
        adapters = self.adapters
        if adapters is not None:
            if not isinstance(adapters, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str | Path) and str(v) for k, v in adapters.items()):
                raise EngineConfigError(
                    f"adapters={adapters!r}: give a dict of adapter name -> PEFT checkpoint directory, "
                    "e.g. {'sql': '/models/sql-lora'}")
            self.adapters = {k: str(v) for k, v in adapters.items()}
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise EngineConfigError(f"{name}={value!r}: give a whole number >= 1, or None to size it "
                                        "from the adapters given")

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine keeps a LoRA adapter pool (adapters given, or a pool size set)."""
        return bool(self.adapters) or self.max_loras is not None

    def _check_unimplemented(self) -> None:
        """LMDeploy options for features this engine lacks: refused unless left at their default."""
        if self.use_logn_attn:
            raise EngineConfigError(
                "use_logn_attn=True: logarithmic attention scaling (Qwen-1) is not implemented; "
                "use use_logn_attn=False")
        if self.eviction_type not in _EVICTION_TYPES:
            raise EngineConfigError(f"eviction_type={self.eviction_type!r}: use 'recompute'")
        if self.eviction_type == "copy":
            raise EngineConfigError(
                "eviction_type='copy': swapping evicted KV blocks to CPU memory is not implemented; "
                "use eviction_type='recompute' (preempted sequences are recomputed)")
        if self.num_cpu_blocks < 0:
            raise EngineConfigError(f"num_cpu_blocks={self.num_cpu_blocks}: must be 0")
        if self.num_cpu_blocks:
            raise EngineConfigError(
                f"num_cpu_blocks={self.num_cpu_blocks}: there is no CPU swap space (preempted sequences "
                "are recomputed); use num_cpu_blocks=0 and size the GPU cache with cache_max_entry_count")
        if self.shared_cache:
            raise EngineConfigError(
                "shared_cache=True: sharing one KV cache between engines is not implemented; use "
                "shared_cache=False and send every request to one pipeline or server")

    def _warn_no_effect(self) -> None:
        """LMDeploy options that only tune something done differently here: one warning each."""
        if self.model_name:
            logger.warning(
                "EngineConfig.model_name=%r has no effect: the chat template comes from the model or "
                "ChatTemplateConfig(model_name=...), the served name from --model-name", self.model_name)
        if self.model_format == "gguf":
            logger.warning(
                "EngineConfig.model_format='gguf' has no effect: a .gguf file is recognised by its suffix "
                "and any other path is read as a Hugging Face checkpoint")
        if self.max_prefill_iters != 1:
            logger.warning(
                "EngineConfig.max_prefill_iters=%s has no effect: a prompt is prefilled in as many "
                "steps of max_prefill_token_num (%s) tokens as it needs", self.max_prefill_iters,
                self.max_prefill_token_num)
        if self.prefill_interval != 16:
            logger.warning(
                "EngineConfig.prefill_interval=%s has no effect: waiting prompts join every step, in "
                "chunks beside the running decodes (max_prefill_token_num sets the step's size)",
                self.prefill_interval)
        if self.thread_safe:
            logger.warning(
                "EngineConfig.thread_safe=True has no effect: a pipeline can always be called from "
                "several threads")

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


def parse_cache_size(text: str) -> float | int | str:
    """``--cache-max-entry-count``'s value, as every command reads it (``EngineConfig``'s meaning):
    an integer is a number of blocks ('2000'), a decimal a fraction of free memory ('0.8') or,
    above 1, GiB ('2.5'), and a size names its unit ('4GiB')."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


# LMDeploy users import these names; they are the same config here.
TurbomindEngineConfig = EngineConfig
PytorchEngineConfig = EngineConfig
