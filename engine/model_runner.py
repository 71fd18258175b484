"""Runs one scheduled step on the model: build the flattened batch, forward, sample.

The batch is one variable-length sequence of tokens with no padding; block tables and slot
mappings tell attention where each sequence's KV lives in the paged cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.engine.attention_metadata import AttentionMetadata, set_attention_metadata
from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import EngineConfigError
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.models import build_model
from conveyor.engine.sampler import Sampler
from conveyor.engine.scheduler import SchedulerOutput
from conveyor.engine.sequence import Sequence
from conveyor.engine.weight_loader import load_model

logger = logging.getLogger(__name__)

_LOGIT_ROWS_PER_CHUNK = 1024  # bounds the [rows, vocab] float32 logits of a scoring pass


@dataclass(frozen=True)
class TokenSample:
    """The token sampled for one sequence in one step."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise EngineConfigError("cannot read free memory; set cache_max_entry_count to a number of blocks (int)")


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler."""

    def __init__(self, model_path: Path, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype):
        self.model_config = model_config
        self.config = config
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        # The rotary table must reach session_len when that is set past the model's own context.
        self.model = build_model(model_config, dtype=dtype, device=device,
                                 rope_scaling_factor=config.rope_scaling_factor,
                                 max_position=config.session_len)
        load_model(self.model, model_path)
        self.model.eval()
        self.num_blocks = self._num_cache_blocks()
        shape = (model_config.num_layers, self.num_blocks, self.block_size,
                 model_config.num_kv_heads, model_config.head_dim)
        try:
            self.k_cache = torch.empty(shape, dtype=dtype, device=device)
            self.v_cache = torch.empty(shape, dtype=dtype, device=device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise EngineConfigError(
                f"could not allocate a KV cache of {self.num_blocks} blocks ({exc}); "
                "lower cache_max_entry_count"
            ) from exc
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]
        self.sampler = Sampler()
        logger.info("KV cache: %d blocks of %d tokens", self.num_blocks, self.block_size)

    def _block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def _num_cache_blocks(self) -> int:
        kind, value = self.config.cache_bytes_or_blocks()
        if kind == "blocks":
            return int(value)
        if kind == "fraction":
            value *= _available_memory(self.device)
        blocks = int(value // self._block_bytes())
        if blocks < 1:
            raise EngineConfigError(
                f"cache_max_entry_count={self.config.cache_max_entry_count!r} leaves no room for one "
                f"KV block ({self._block_bytes()} bytes); raise it"
            )
        return blocks

    def _metadata(self, seqs: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten (sequence, number of new tokens) pairs into model inputs and attention metadata."""
        bs = self.block_size
        input_ids, positions, slots, cu_q, lens_k = [], [], [], [0], []
        for seq, n in seqs:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu_q.append(cu_q[-1] + n)
            lens_k.append(start + n)
        width = max(len(seq.block_table) for seq, _ in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            seqlens_k=torch.tensor(lens_k, dtype=torch.int32, device=dev),
            max_seqlen_q=max(n for _, n in seqs),
            max_seqlen_k=max(lens_k),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta

    @torch.inference_mode()
    def _forward(self, seqs: list[tuple[Sequence, int]]) -> torch.Tensor:
        ids, pos, meta = self._metadata(seqs)
        set_attention_metadata(meta)
        try:
            return self.model(ids, pos)
        finally:
            set_attention_metadata(None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, generators: dict[int, torch.Generator]) -> dict[int, TokenSample]:
        """Run one step; returns the sampled token of every sequence that reached its end."""
        seqs = [(s.seq, s.num_new_tokens) for s in out.scheduled]
        hidden = self._forward(seqs)
        rows, sampling = [], []
        end = 0
        for item in out.scheduled:
            end += item.num_new_tokens
            if item.samples:
                rows.append(end - 1)
                sampling.append(item.seq)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        result = self.sampler(
            logits,
            [s.params for s in sampling],
            [s.token_ids for s in sampling],
            [s.num_output_tokens for s in sampling],
            [generators.get(s.seq_id) for s in sampling],
        )
        samples = {}
        for i, seq in enumerate(sampling):
            samples[seq.seq_id] = TokenSample(
                result.token_ids[i],
                result.logprobs[i] if result.logprobs is not None else None,
                result.top_logprobs[i] if result.top_logprobs is not None else None,
            )
        return samples

    @torch.inference_mode()
    def score_chunk(self, seq: Sequence, n: int) -> torch.Tensor:
        """Forward ``n`` more tokens of ``seq`` (blocks already allocated); returns the summed
        negative log-likelihood of each next token inside the chunk and the one after it."""
        hidden = self._forward([(seq, n)])
        start = seq.num_computed_tokens
        targets = seq.token_ids[start + 1 : start + n + 1]
        total = torch.zeros((), dtype=torch.float64)
        for lo in range(0, len(targets), _LOGIT_ROWS_PER_CHUNK):
            hi = min(lo + _LOGIT_ROWS_PER_CHUNK, len(targets))
            logits = self.model.compute_logits(hidden[lo:hi])
            tgt = torch.tensor(targets[lo:hi], device=logits.device)
            nll = torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="sum")
            total += nll.double().cpu()
        return total
