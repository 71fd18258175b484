"""Calibration for post-training quantization: text in, per-layer activations out.

Shared by the quantization tools (AWQ's search and SmoothQuant's activation ranges):

- ``read_text`` / ``calibration_windows``: a ``.txt`` or ``.jsonl`` file -> ``[n, seqlen]`` token
  windows spread over the whole text.
- ``read_model_config`` / ``pick_device`` / ``pick_dtypes`` / ``load_causal_lm``: the checked
  model directory and the calibration model's device and dtypes.
- ``LayerwiseRunner``: a Hugging Face causal LM run one decoder layer at a time over those
  windows, so the peak memory is the model plus one layer's activations. ``record`` runs a layer
  and returns, for chosen submodules, the per-input-channel mean and max of ``|x|`` over every
  calibration token plus the raw inputs of the first few samples (for searches that re-run a
  block); ``forward`` runs a layer; ``advance`` moves on to the next layer's inputs.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import QuantizationError
from .layouts import LAYOUTS

logger = logging.getLogger(__name__)


def read_text(path: str | Path) -> str:
    """The text of a ``.txt`` file, or the ``"text"`` fields of a ``.jsonl`` file joined by blank lines."""
    path = Path(path)
    if not path.is_file():
        raise QuantizationError(f"calibration dataset {path} is not a file: pass a .txt or .jsonl file (LMDeploy's "
                                "named sets, ptb, wikitext2, c4, pileval, are hub downloads: save one as text)")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return path.read_text(encoding="utf-8")
    if suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise QuantizationError(f"{path}:{number} is not valid JSON ({exc.msg})") from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise QuantizationError(f'{path}:{number} has no string "text" field')
                texts.append(record["text"])
        return "\n\n".join(texts)
    raise QuantizationError(f"calibration dataset {path} must be a .txt or .jsonl (\"text\" field) file")


def calibration_windows(token_ids: list[int], num_samples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``[n, seqlen]`` non-overlapping windows spread evenly over ``token_ids``, in a seeded shuffled order.

    The order is shuffled so that any prefix of the samples (the ones a search re-runs) still
    covers the whole text. Fewer than ``num_samples`` windows are returned, with a warning, when
    the text is too short; none at all is an error.
    """
    available = len(token_ids) // seqlen
    if available < 1:
        raise QuantizationError(
            f"the calibration text has {len(token_ids)} tokens, fewer than one window of --calib-seqlen {seqlen}: "
            "use a longer text or a shorter --calib-seqlen")
    n = min(num_samples, available)
    if n < num_samples:
        logger.warning("the calibration text has %d tokens: using %d windows of %d tokens instead of %d",
                       len(token_ids), n, seqlen, num_samples)
    stride = len(token_ids) // n
    ids = torch.tensor(token_ids, dtype=torch.long)
    windows = torch.stack([ids[i * stride:i * stride + seqlen] for i in range(n)])
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return windows[order]


def tokenize_for_calibration(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (the windows are cut from the middle of a text)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class InputRecord:
    """What ``LayerwiseRunner.record`` saw entering one module.

    ``absmean`` / ``absmax``: per input channel, over every calibration token (float32).
    ``kept``: the inputs of the first ``keep_samples`` samples, ``[n, seqlen, channels]``.
    """

    absmean: torch.Tensor
    absmax: torch.Tensor
    kept: torch.Tensor | None
    tokens: int


class _Recorder:
    """A forward pre-hook that accumulates ``|x|`` statistics and keeps the first samples' inputs."""

    def __init__(self, keep_samples: int, dtype: torch.dtype) -> None:
        self.keep_samples = keep_samples
        self.dtype = dtype
        self.abs_sum: torch.Tensor | None = None
        self.abs_max: torch.Tensor | None = None
        self.tokens = 0
        self.kept: list[torch.Tensor] = []
        self.kept_samples = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        flat = x.reshape(-1, x.shape[-1]).abs().float()
        total, peak = flat.sum(0), flat.amax(0)
        if self.abs_sum is None:
            self.abs_sum, self.abs_max = total, peak
        else:
            self.abs_sum += total
            torch.maximum(self.abs_max, peak, out=self.abs_max)
        self.tokens += flat.shape[0]
        if self.kept_samples < self.keep_samples:
            take = x[: self.keep_samples - self.kept_samples]
            self.kept.append(take.to(self.dtype, copy=True))
            self.kept_samples += take.shape[0]

    def result(self) -> InputRecord:
        assert self.abs_sum is not None, "the recorded module never ran"
        kept = torch.cat(self.kept) if self.kept else None
        return InputRecord(self.abs_sum / self.tokens, self.abs_max, kept, self.tokens)


class LayerwiseRunner:
    """Runs a Hugging Face causal LM of a known layout (layouts.py) one decoder layer at a time over
    calibration windows.

    The decoder layers are called as transformers' own modules with SDPA attention and no mask
    (eager attention and the causal mask where SDPA is not offered), i.e. causal attention over
    each full window (windows are never padded; sliding windows are not applied). With
    ``compute_dtype`` other than the weights' dtype, forward passes run under ``torch.autocast``
    (e.g. float32 weights, bfloat16 matmuls on a CPU with AMX: about four times faster).
    """

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, batch_size: int = 1,
                 compute_dtype: torch.dtype | None = None) -> None:
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in ("sdpa", "eager"):
            raise QuantizationError("the calibration model must use SDPA or eager attention "
                                    f"(attn_implementation='sdpa' or 'eager'), not {attention!r}")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or self.dtype
        self.batch_size = batch_size
        self.seqlen = input_ids.shape[1]
        self.num_samples = input_ids.shape[0]
        inner = model.model
        with torch.no_grad():
            self.hidden: list[torch.Tensor] = [
                inner.embed_tokens(batch.to(self.device)) for batch in input_ids.split(batch_size)]
            positions = torch.arange(self.seqlen, device=self.device).unsqueeze(0)
            # cos/sin of shape [1, seqlen, head_dim]: they broadcast over any batch size. Gemma 3
            # rotates its sliding and its full layers differently: one pair per layer type.
            rotary = inner.rotary_emb
            if "layer_type" in inspect.signature(rotary.forward).parameters:
                self.position_embeddings = {kind: rotary(self.hidden[0], positions, kind)
                                            for kind in set(model.config.layer_types)}
            else:
                self.position_embeddings = rotary(self.hidden[0], positions)
        self.position_ids = positions
        # SDPA is causal by itself when given no mask; eager attention (Gemma 2, whose soft cap
        # SDPA lacks) adds the mask it is given, so it gets the causal one spelled out.
        self.attention_mask = None
        if attention == "eager":
            self.attention_mask = torch.full((self.seqlen, self.seqlen), float("-inf"), device=self.device,
                                             dtype=self.dtype).triu(1)[None, None]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward pass runs in: autocast to ``compute_dtype`` when it differs from the weights'."""
        if self.compute_dtype == self.dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers, in order."""
        return self.model.model.layers

    def rotary_for(self, attn: nn.Module) -> Any:
        """The (cos, sin) pair ``attn`` rotates with: its layer type's where they differ by type."""
        if isinstance(self.position_embeddings, dict):
            return self.position_embeddings[attn.layer_type]
        return self.position_embeddings

    def layer_kwargs(self, layer: nn.Module) -> dict[str, Any]:
        """Keyword arguments of ``layer``'s forward besides the hidden states."""
        return {"attention_mask": self.attention_mask, "position_ids": self.position_ids,
                "position_embeddings": self.rotary_for(layer.self_attn)}

    def attention(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A layer's self-attention block on its (normed) input ``[b, seqlen, hidden]``."""
        return attn(x, position_embeddings=self.rotary_for(attn), attention_mask=self.attention_mask)[0]

    @torch.no_grad()
    def forward(self, layer: nn.Module) -> list[torch.Tensor]:
        """``layer`` applied to every batch of the current inputs (the outputs in the weights' dtype)."""
        kwargs = self.layer_kwargs(layer)
        with self.autocast():
            return [self._output(layer(h, **kwargs)).to(self.dtype) for h in self.hidden]

    @torch.no_grad()
    def record(self, layer: nn.Module, modules: Mapping[str, nn.Module],
               keep_samples: int = 0) -> tuple[list[torch.Tensor], dict[str, InputRecord]]:
        """Run ``layer`` over every batch, recording what enters each of ``modules`` (name -> submodule).

        Returns the layer's outputs (the next layer's unquantized inputs) and one ``InputRecord``
        per name, keeping the inputs of the first ``keep_samples`` samples.
        """
        recorders = {name: _Recorder(keep_samples, self.dtype) for name in modules}
        handles = [module.register_forward_pre_hook(recorders[name]) for name, module in modules.items()]
        try:
            outputs = self.forward(layer)
        finally:
            for handle in handles:
                handle.remove()
        return outputs, {name: rec.result() for name, rec in recorders.items()}

    def advance(self, outputs: list[torch.Tensor]) -> None:
        """Make ``outputs`` (from ``record`` or ``forward``) the next layer's inputs."""
        self.hidden = outputs

    def batches(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        """``x`` ``[n, ...]`` in chunks of the runner's batch size."""
        yield from x.split(self.batch_size)

    @staticmethod
    def _output(out: Any) -> torch.Tensor:
        # transformers < 5 returns a tuple from decoder layers, 5.x a tensor.
        return out[0] if isinstance(out, tuple) else out


def load_causal_lm(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A Hugging Face causal LM for calibration: SDPA attention (eager where the family's layout says so), eval
    mode, no grads."""
    from transformers import AutoModelForCausalLM

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    attention = LAYOUTS[model_type].attention if model_type in LAYOUTS else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attention)
    model.requires_grad_(False)
    return model.eval().to(device)


def checked_model_dir(model_dir: str | Path, tool: str) -> tuple[Path, dict]:
    """``model_dir`` as a Path and its config.json, if it is an unquantized model directory of a known layout."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise QuantizationError(f"model {model_dir} is not a directory: pass a Hugging Face model directory")
    return model_dir, read_model_config(model_dir, tool)


def model_windows(model_dir: Path, text: str, num_samples: int, seqlen: int) -> torch.Tensor:
    """``calibration_windows`` of ``text`` tokenized by the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return calibration_windows(tokenize_for_calibration(tokenizer, text), num_samples, seqlen)


def read_model_config(model_dir: Path, tool: str) -> dict:
    """The config.json of an unquantized model directory of a known layout, or QuantizationError naming the fix."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise QuantizationError(
            f"{model_dir} is not a Hugging Face model directory (no config.json): pass the directory of an "
            "fp16/bf16/fp32 checkpoint")
    config = json.loads(config_path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise QuantizationError(f"{model_dir} is already quantized ({method})")
    model_type = config.get("model_type")
    if model_type not in LAYOUTS:
        raise QuantizationError(
            f"{tool} supports model types {', '.join(LAYOUTS)}; {model_dir} is {model_type!r}, whose decoder layers "
            "it does not know how to scale (their norms and linears are not laid out as Llama's or Gemma's): serve its "
            "fp16/bf16 checkpoint, with quant_policy=8 or 4 for a smaller KV cache")
    return config


def pick_device(device: str) -> torch.device:
    """``auto``: cuda when there is one, else cpu; any other name as torch reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16; Linux /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtypes(dtype: str, device: torch.device, hf_config: dict) -> tuple[torch.dtype, torch.dtype]:
    """(weights dtype, compute dtype) of the calibration model.

    On CPU the weights stay float32 (the checkpoint is quantized from them) and ``auto`` computes
    in bfloat16 where the CPU does that natively, else float32. On a GPU both are the model's
    half type (``auto``) or the named one.
    """
    if dtype != "auto" and dtype not in _DTYPES:
        raise QuantizationError(f"dtype {dtype!r}: use auto, float32, float16 or bfloat16")
    if device.type == "cpu":
        if dtype == "auto":
            return torch.float32, torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        return torch.float32, _DTYPES[dtype]
    if dtype == "auto":
        stored = hf_config.get("dtype") or hf_config.get("torch_dtype")
        half = torch.bfloat16 if stored == "bfloat16" else torch.float16
        return half, half
    return _DTYPES[dtype], _DTYPES[dtype]
