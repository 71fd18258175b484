"""Runs one scheduled step on the model: build the flattened batch, forward, sample.

The batch is one variable-length sequence of tokens with no padding; block tables and slot
mappings tell attention where each sequence's KV lives in the paged cache.

On CUDA:

* inputs are built on the host into pinned tensors and copied with ``non_blocking``, and the
  attention layers get ``max_seqlen_q/k`` from the metadata, so a step syncs with the device
  once, when the sampled token ids come back;
* ``launch`` queues a step and returns at once with its sampled ids still on the device; an
  input token that is still pending (sampled by the previous step and not yet read back:
  past the end of ``Sequence.token_ids``) is gathered on the device from that step's ids, so
  the engine can build and queue step N+1 while the GPU runs step N;
* a step in which every sequence decodes one token replays a captured CUDA graph
  (``engine/cuda_graph.py``); other steps (prefill, mixed, too large) run eagerly.
  ``EngineConfig.eager_mode`` (or ``runner.use_cuda_graphs = False``) turns graphs off;
* the KV cache is sized after a profiling forward of ``max_prefill_token_num`` tokens:
  ``cache_max_entry_count`` (a fraction) applies to the memory still free after the weights
  *and* that forward's peak activations (LMDeploy's meaning).

Tensor parallel: every rank holds a runner over its shard of the model (and cache). Rank 0's
``launch`` first turns the scheduled step into a ``StepPlan`` (host lists only), hands it to
the other ranks (``workers``, ``engine/tp_workers.py``), then executes it; the others
``follow`` the same plans. All ranks thus run the same kernels and meet in the same
collectives; rank 0 alone samples and broadcasts the sampled ids, which the next step's pending
inputs read on every rank. A step whose every row is plain greedy (``vocab_parallel_greedy``,
decided by rank 0 and carried by the plan, so every rank runs the same collectives) gathers no
logits and samples nothing: each rank takes the argmax of its vocabulary shard and the ranks
exchange one (value, index) pair per row (``layers/vocab_argmax.py``), so every rank ends with
the ids, which then need no broadcast. The cache holds this rank's kv heads, and
``num_blocks`` is the smallest rank's budget.

The cache's geometry is the model's ``KVCacheSpec`` (``kv_cache_spec``): kv heads, key and value
widths, and whether the values are a view of the keys (multi-head latent attention's one latent
row a token, replicated on every rank); the allocation, the block size in bytes and the
tensor-parallel head split all read it.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from .attention_metadata import AttentionMetadata, set_attention_metadata
from .config import EngineConfig
from .cuda_graph import DecodeGraphs
from .distributed import kv_head_range, tp_group
from ..protocol.errors import EngineConfigError
from .model_config import ModelConfig
from .multimodal import image_rows, mrope_delta, mrope_positions
from .model_registry import model_class
from .layers import RMSNorm
from .layers.layer_norm import LayerNorm
from .layers.attention import MixedBatchMetadata
from .layers.lora import set_lora_segments
from .lora.manager import LoRAManager, pool_shape
from .lora.checkpoint import read_peft_lora
from .lora.segments import step_segments
from .models import build_model
from .sampler import DeviceSamples, Sampler, vocab_parallel_greedy
from ..kernels.kv_layout import KVCacheSpec
from ..protocol.sampling import SamplingParams
from ..protocol.multimodal import ImageInput
from ..protocol.tp import StepKind, StepPlan
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .weight_loader import after_loading, load_model

logger = logging.getLogger(__name__)

_LOGIT_ROWS_PER_CHUNK = 1024  # bounds the [rows, vocab] float32 logits of a scoring pass
DUMMY_WEIGHT_SEED = 0


@dataclass
class LaunchedStep:
    """A step queued on the device: which sequences sample (row order of the sampled ids), the
    request each row was launched for, and the sampler's device-side result."""

    sampling: list[Sequence]
    samples: DeviceSamples | None  # None when no sequence samples in this step

    def __post_init__(self) -> None:
        self.request_ids = [seq.request_id for seq in self.sampling]
        self._rows = {seq.seq_id: row for row, seq in enumerate(self.sampling)}

    def row_of(self, seq: Sequence) -> int:
        """The row of ``seq``'s sampled token in this step's ids."""
        return self._rows[seq.seq_id]


class StepHook(Protocol):
    """Watches the runner's steps (benchmarks time the device work and count graph replays)."""

    def begin(self, graph: bool) -> None:
        """Called before a step's first device work is queued."""

    def end(self) -> None:
        """Called after a step's last device work (sampling) is queued."""


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise EngineConfigError("cannot read free memory; set cache_max_entry_count to a number of blocks (int)")


def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
    """The cache geometry of ``config``'s model: its class's ``kv_cache_spec(config)`` where it
    declares one (MLA's latent row), else a key and a value of ``head_dim`` for each kv head."""
    declared = getattr(model_class(config.architecture), "kv_cache_spec", None)
    if declared is not None:
        return declared(config)
    return KVCacheSpec(config.num_kv_heads, config.head_dim, config.head_dim)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = DUMMY_WEIGHT_SEED) -> None:
    """Seeded random weights, drawn on the parameters' own device (no weight files).

    Matrices ~ N(0, 0.02) (the usual initializer range), norm scales 1, biases 0: values that keep
    the activations finite through a deep stack, so timings are those of real data.
    """
    params = list(model.parameters())
    gen = torch.Generator(device=params[0].device).manual_seed(seed) if params else None
    norms = {id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))}
    done: set[int] = set()
    for module in model.modules():  # quantized layers know what random weights of theirs look like
        init = getattr(getattr(module, "method", None), "init_dummy", None)
        if init is not None:
            init(module, gen)
            done.update(id(p) for p in module.parameters(recurse=False))
    for p in params:
        if id(p) in done:
            continue
        if id(p) in norms:
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    after_loading(model)


# Encoder rows a runner keeps of the last images it encoded (at least the newest image's): 16,384
# rows are 28 LLaVA-1.5 images (576 rows), 64 Qwen2.5-VL 448-pixel ones (256), 1.2 InternVL images
# of 13 tiles; 134 MB at a hidden size of 4,096 in 16 bits, counted in the memory profile.
IMAGE_FEATURE_ROWS = 16384


def _pixels(image: ImageInput) -> torch.Tensor:
    """An image's pixel data as a host tensor of its shape and dtype."""
    return torch.frombuffer(bytearray(image.pixels), dtype=getattr(torch, image.dtype)).view(image.shape)


class ModelRunner:
    """Owns the model weights, the KV cache tensors, the decode CUDA graphs and the sampler."""

    def __init__(self, model_path: Path, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype):
        self.model_config = model_config
        self.config = config
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        self.tp = tp_group()
        self.kv_spec = kv_cache_spec(model_config)
        self.num_kv_heads = kv_head_range(self.kv_spec.num_kv_heads, self.tp.rank, self.tp.size)[1]  # this rank's
        self.workers = None  # rank 0 under tensor parallel: the other ranks (engine/tp_workers.py)
        try:
            # The key cache's layout, and the value cache's (None: values are a view of the keys).
            self.kv_layout, self.v_layout = self.kv_spec.layouts(config.quant_policy)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        self.max_model_len = config.session_len or model_config.max_position_embeddings
        # The rotary table must reach session_len when that is set past the model's own context.
        self.model = build_model(model_config, dtype=dtype, device=device,
                                 rope_scaling_factor=config.rope_scaling_factor,
                                 max_position=config.session_len)
        if getattr(config, "load_format", "auto") == "dummy":
            init_dummy_weights(self.model)
        else:
            load_model(self.model, model_path)
        self.model.eval()
        # LoRA adapters' device pool, before the memory profile (it counts as weights).
        self.lora: LoRAManager | None = self._lora_pool() if config.lora_enabled else None
        self.sampler = Sampler()
        self.step_hooks: list[StepHook] = []
        # The vision encoder's rows of the last images seen, by digest: a repeated image whose
        # prefix-cache hit ends inside its span (a block boundary rarely falls on a span's end)
        # needs only its later rows, which it takes from here instead of the tower.
        self._image_features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._image_feature_rows = 0
        # Qwen2-VL's multimodal rotary: the tower's spatial merge size (0: positions are indices).
        self.mrope_merge: int = getattr(self.model, "mrope_merge", 0)
        # a model whose layers treat image rows apart (XComposer2's Partial LoRA) names them in forward
        self.takes_image_mask: bool = "image_mask" in inspect.signature(type(self.model).forward).parameters
        self.activation_bytes = self._profile_activations() if device.type == "cuda" else 0
        self.num_blocks = self._num_cache_blocks()
        # The blocks the block manager keeps for sequences' first blocks (the layout's per-sequence
        # state has a row for each of these only).
        self.num_head_blocks = self.kv_layout.reserved_head_blocks(config.max_batch_size, self.num_blocks)
        lead = (model_config.num_layers, self.num_blocks, self.block_size, self.num_kv_heads)
        try:
            # Zeroed on the GPU (cheap there): padded graph rows read block 0, and stale NaN bit
            # patterns are better never met. The CPU keeps empty(): zeroing gigabytes costs seconds.
            alloc = torch.zeros if device.type == "cuda" else torch.empty
            self.k_cache, self.k_scales = self.kv_layout.allocate(lead, dtype, device, alloc)
            if self.v_layout is None:  # no value cache: the values are each key's first v_dim columns
                self.v_cache, self.v_scales = self.k_cache[..., : self.kv_spec.v_dim], None
            else:
                self.v_cache, self.v_scales = self.v_layout.allocate(lead, dtype, device, alloc)
            self.k_centres = self.kv_layout.allocate_centres(lead[0], self.num_head_blocks, lead[3], device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise EngineConfigError(
                f"could not allocate a KV cache of {self.num_blocks} blocks ({exc}); "
                f"lower cache_max_entry_count (now {config.cache_max_entry_count!r})"
            ) from exc
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]
            if self.k_scales is not None:
                layer.k_scales, layer.v_scales = self.k_scales[i], self.v_scales[i]
                layer.k_centres = self.k_centres[i]
        logger.info("KV cache: %d blocks of %d tokens (%s)", self.num_blocks, self.block_size,
                    f"int{config.quant_policy}" if config.quant_policy else str(dtype).removeprefix("torch."))
        self.use_cuda_graphs = device.type == "cuda" and not config.eager_mode
        self.decode_graphs: DecodeGraphs | None = None
        if self.use_cuda_graphs:
            try:
                self.decode_graphs = self._decode_graphs(capture=True)
            except RuntimeError as exc:  # a capture failure costs speed, not the engine
                logger.warning("decode CUDA graph capture failed (%s); decoding eagerly", exc)
                self.use_cuda_graphs = False

    def _lora_pool(self) -> LoRAManager:
        """The slot pool, sized from the config and its start-up adapters, which it registers
        (ids 1, 2, ... in the config's order, the same on every rank)."""
        start = {name: read_peft_lora(path, download_dir=self.config.download_dir)
                 for name, path in (self.config.adapters or {}).items()}
        slots, rank = pool_shape(self.config, [lora.rank for lora in start.values()])
        manager = LoRAManager(self.model, self.model_config.num_layers, slots, rank, self.dtype, self.device,
                              self.config.download_dir)
        for adapter_id, (name, lora) in enumerate(start.items(), start=1):
            manager.register(adapter_id, name, str(lora.path), lora)
        return manager

    def register_adapter(self, adapter_id: int, name: str, path: str) -> None:
        """Register a LoRA adapter on this rank and (tensor parallel rank 0) on the others; raises
        AdapterError (nothing is sent) when it does not fit."""
        self.lora.register(adapter_id, name, path)
        self._send(StepPlan(StepKind.ADAPTER, adapter_ops=[(adapter_id, name, path)]))

    def forget_adapters(self, adapter_ids: list[int]) -> None:
        """Drop unloaded adapters' weights here and on the other ranks."""
        for adapter_id in adapter_ids:
            self.lora.forget(adapter_id)
        if adapter_ids:
            self._send(StepPlan(StepKind.ADAPTER, adapter_ops=[(i, "", "") for i in adapter_ids]))

    def _adapter_ops(self, ops: list[tuple[int, str, str]]) -> None:
        """A follower rank's side of ``register_adapter`` / ``forget_adapters``."""
        for adapter_id, name, path in ops:
            if path:
                self.lora.register(adapter_id, name, path)
            else:
                self.lora.forget(adapter_id)

    def _attach_lora(self, plan: StepPlan, seqs: list[Sequence]) -> None:
        """Give ``plan`` its sequences' adapter slots (``seqs`` in the plan's order), paging in
        adapters that are not resident; nothing when none of them runs an adapter."""
        if self.lora is None or not any(s.adapter_id for s in seqs):
            return
        plan.lora_slots, plan.lora_loads = self.lora.slots_for([s.adapter_id for s in seqs])

    def _page_in(self, plan: StepPlan) -> None:
        """Copy the adapters ``plan`` pages in into their slots (every rank, before the forward)."""
        if plan.lora_loads:
            self.lora.apply_loads(plan.lora_loads)

    def release_graphs(self, wait: bool = True) -> None:
        """Free the decode graphs; later decode steps run eagerly. Tensor parallel's shutdown
        calls it before leaving the NCCL group: on two H200s (torch 2.11, NCCL 2.28) NCCL's
        abort and destroy both waited forever, on every rank, while graphs that captured its
        collectives were alive, and returned at once without them. ``wait=False`` after a rank
        failed (``DecodeGraphs.release``)."""
        if self.decode_graphs is not None:
            self.decode_graphs.release(wait)
            self.decode_graphs = None
        self.use_cuda_graphs = False

    def _decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Static decode buffers (and, with ``capture``, their CUDA graphs) for this runner."""
        return DecodeGraphs(
            self.model,
            max_batch_size=self.config.max_batch_size,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            max_seqlen_k=self.max_model_len,
            block_size=self.block_size,
            device=self.device,
            capture=capture,
            lora_slots=self.lora.num_slots if self.lora is not None else 0,
            # Under tensor parallel each step picks how its logits end (gathered, or the
            # vocab-parallel argmax), so the graphs stop before either.
            split_head=self.tp.active,
        )

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak bytes a forward of ``max_prefill_token_num`` tokens (plus the LM head and sampler
        on ``max_batch_size`` rows) allocates beyond the weights; runs before the cache exists,
        so attention takes its cache-less path."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        total = self.config.max_prefill_token_num
        # Several sequences when the budget exceeds the longest allowed one (positions must stay
        # inside the rotary table).
        per_seq = min(total, self.max_model_len)
        lens = [per_seq] * (total // per_seq) + ([total % per_seq] if total % per_seq else [])
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seqlens_k=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_seqlen_q=max(lens),
            max_seqlen_k=max(lens),
        )
        ids = torch.zeros(total, dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        set_attention_metadata(meta)
        try:
            hidden = self.model(ids, pos)
        finally:
            set_attention_metadata(None)
        rows = min(self.config.max_batch_size, total)
        logits = self.model.compute_logits(hidden[-rows:])
        extra = self._warm_up_vision_tower(total)
        # top-p sampling is the sampler's largest footprint (a sort of the whole vocabulary).
        params = [SamplingParams(temperature=1.0, top_k=0, top_p=0.9)] * rows
        self.sampler(logits, params, [[]] * rows, [0] * rows, list(range(rows)))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del hidden, logits
        torch.cuda.empty_cache()
        used = max(peak - before, 0) + extra
        logger.info("profiling forward of %d tokens: %.2f GiB of activations", total, used / 2**30)
        return used

    def _warm_up_vision_tower(self, tokens: int) -> int:
        """A vision model's tower once on the largest images one step of ``tokens`` holds (inside
        the memory profile, and so that its first-call costs are not a request's); returns the
        bytes the kept encoder rows may take (0 for a text model)."""
        spec = self.model.warmup_images(tokens) if hasattr(self.model, "warmup_images") else None
        if spec is None:
            return 0
        shape, grids = spec
        self.model.encode_images(torch.zeros(shape, device=self.device, dtype=self.dtype), grids)
        logger.info("warmed up the vision tower on %d images of %s", shape[0], shape[1:])
        return IMAGE_FEATURE_ROWS * self.model_config.hidden_size * self.dtype.itemsize

    def _block_bytes(self) -> int:
        """Bytes of one block over all layers, keys and values: a quantized cache's codes and
        scales (``KVCacheLayout``), so a smaller cache buys proportionally more tokens; values
        that are a view of the keys (``KVCacheSpec.shares_v``) cost nothing more."""
        per_head = self.kv_layout.bytes_per_head(self.dtype)
        if self.v_layout is not None:
            per_head += self.v_layout.bytes_per_head(self.dtype)
        return self.model_config.num_layers * self.block_size * self.num_kv_heads * per_head

    def _num_cache_blocks(self) -> int:
        """This rank's budget, or under tensor parallel the smallest rank's (every rank must
        hold every block)."""
        return self.tp.min(self._cache_budget(), self.device)

    def _cache_budget(self) -> int:
        kind, value = self.config.cache_bytes_or_blocks()
        if kind == "blocks":
            return int(value)
        if kind == "fraction":
            # LMDeploy's meaning: a fraction of what the weights and the activations leave free.
            value *= max(_available_memory(self.device) - self.activation_bytes, 0)
        centres = self.kv_layout.centre_table_bytes(self.model_config.num_layers, self.num_kv_heads,
                                                    self.config.max_batch_size)
        blocks = int(max(value - centres, 0) // self._block_bytes())
        if blocks < 1:
            raise EngineConfigError(
                f"cache_max_entry_count={self.config.cache_max_entry_count!r} leaves no room for one "
                f"KV block ({self._block_bytes()} bytes); raise it"
            )
        return blocks

    @staticmethod
    def _flatten(seqs: list[tuple[Sequence, int]], block_size: int, prev: LaunchedStep | None,
                 kind: StepKind = StepKind.FORWARD, mrope_merge: int = 0) -> StepPlan:
        """Lay (sequence, number of new tokens) pairs back to back as a plan's host lists.
        ``mrope_merge``: a multimodal-rotary model's merge size (its positions are not indices)."""
        bs = block_size
        ids, positions, slots, cu_q, lens_k, pending = [], [], [], [0], [], []
        centre_rows, new_centres = [], []
        images, rows = [], []
        spatial: list[tuple[int, np.ndarray]] = []  # (first row, [3, n] positions) of chunks with image tokens
        for seq, n in seqs:
            start = seq.num_computed_tokens
            shift = 0
            if mrope_merge and seq.images:
                chunk_positions = mrope_positions(seq.images, start, n, mrope_merge)
                if chunk_positions is not None:
                    spatial.append((len(ids), chunk_positions))
                shift = mrope_delta(seq.images, start, mrope_merge)
            if seq.images:
                for row, index, src, count in image_rows(seq.images, start, n, len(ids)):
                    rows.append((row, len(images), src, count))
                    images.append(seq.images[index])
            centre_rows.extend([seq.block_table[0]] * n)
            if start == 0:  # its first chunk: a centred cache computes its key centre here, from the
                # leading tokens the scheduler fixed (the whole chunk when it fixed none: the kernels
                # cap the count)
                new_centres.append((len(ids), min(n, seq.first_chunk_tokens or n), seq.block_table[0]))
            chunk = seq.token_ids[start : start + n]
            if len(chunk) < n:  # its last input was sampled by the step before and is still on the device
                assert len(chunk) == n - 1 and prev is not None, "only the newest token can be pending"
                pending.append((len(ids) + n - 1, prev.row_of(seq)))
                chunk.append(0)
            ids.extend(chunk)
            positions.extend(range(start + shift, start + shift + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu_q.append(cu_q[-1] + n)
            lens_k.append(start + n)
        width = max(len(seq.block_table) for seq, _ in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in seqs]
        three_rows = []
        if spatial:  # the step's text tokens have one position in all three rows
            three = np.tile(np.asarray(positions, dtype=np.int64), (3, 1))
            for first, chunk_positions in spatial:
                three[:, first:first + chunk_positions.shape[1]] = chunk_positions
            three_rows = three.tolist()
        return StepPlan(kind, input_ids=ids, positions=positions, block_tables=tables, slots=slots,
                        cu_seqlens_q=cu_q, seqlens_k=lens_k, num_new=[n for _, n in seqs], pending=pending,
                        centre_rows=centre_rows, new_centres=new_centres, images=images, image_rows=rows,
                        mrope_positions=three_rows)

    @staticmethod
    def _decode_tokens(seqs: list[Sequence], prev: LaunchedStep | None) -> tuple[list[int], list[tuple[int, int]]]:
        """Each decoding sequence's input token (0 where it is still pending on the device) and
        the pending ones' (row, row of ``prev``'s sampled ids)."""
        tokens, pending = [], []
        for i, seq in enumerate(seqs):
            p = seq.num_computed_tokens
            if p < len(seq.token_ids):
                tokens.append(seq.token_ids[p])
            else:
                pending.append((i, prev.row_of(seq)))
                tokens.append(0)
        return tokens, pending

    def _attention_metadata(self, flat: StepPlan) -> AttentionMetadata:
        """Attention metadata of a flattened batch. When the leading sequences bring one token
        each and later ones more (``launch`` orders a mixed batch so), it is a
        ``MixedBatchMetadata``: the decode rows then take the decode kernel."""
        lens_k, num_new = flat.seqlens_k, flat.num_new
        fields = dict(
            slot_mapping=self._to_device(flat.slots, torch.int64),
            block_tables=self._to_device(flat.block_tables, torch.int32),
            cu_seqlens_q=self._to_device(flat.cu_seqlens_q, torch.int32),
            seqlens_k=self._to_device(lens_k, torch.int32),
            max_seqlen_q=max(num_new),
            max_seqlen_k=max(lens_k),
        )
        if self.kv_layout.centred:
            fields["centre_index"] = self._to_device(flat.centre_rows, torch.int32)
            if flat.new_centres:
                fields["new_centres"] = self._to_device(flat.new_centres, torch.int32)
        nd = next((i for i, n in enumerate(num_new) if n != 1), len(num_new))
        if not (0 < nd < len(num_new) and all(n != 1 for n in num_new[nd:])):
            return AttentionMetadata(**fields)
        # Decode rows: views of the whole batch's tensors. Prefill rows: the same views, except
        # the query offsets, renumbered from 0 (one more small copy).
        decode = AttentionMetadata(
            slot_mapping=fields["slot_mapping"][:nd], block_tables=fields["block_tables"][:nd],
            cu_seqlens_q=fields["cu_seqlens_q"][: nd + 1], seqlens_k=fields["seqlens_k"][:nd],
            max_seqlen_q=1, max_seqlen_k=max(lens_k[:nd]),
        )
        prefill = AttentionMetadata(
            slot_mapping=fields["slot_mapping"][nd:], block_tables=fields["block_tables"][nd:],
            cu_seqlens_q=self._to_device([c - nd for c in flat.cu_seqlens_q[nd:]], torch.int32),
            seqlens_k=fields["seqlens_k"][nd:],
            max_seqlen_q=max(num_new[nd:]), max_seqlen_k=max(lens_k[nd:]),
        )
        return MixedBatchMetadata(**fields, num_decode_tokens=nd, decode=decode, prefill=prefill)

    def _inputs(self, plan: StepPlan, prev_ids: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device input ids, positions and attention metadata of a flattened batch."""
        meta = self._attention_metadata(plan)
        ids = self._to_device(plan.input_ids, torch.int64)
        self._gather_pending(ids, plan.pending, prev_ids)
        return ids, self._to_device(plan.mrope_positions or plan.positions, torch.int64), meta

    def _gather_pending(self, ids: torch.Tensor, pending: list[tuple[int, int]], prev_ids: torch.Tensor | None) -> None:
        """Write, on the device, each input still pending from the previous step's sampled ids
        ``prev_ids`` (``pending``: (input row, sampled row) pairs)."""
        if not pending:
            return
        dst, src = zip(*pending)
        ids[self._to_device(list(dst), torch.int64)] = prev_ids[self._to_device(list(src), torch.int64)]

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor; on CUDA through pinned memory without a sync (the
        caching host allocator keeps the pinned block alive until the copy has read it)."""
        if self.device.type == "cuda":
            return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _begin_step(self, graph: bool) -> None:
        for hook in self.step_hooks:
            hook.begin(graph)

    def _end_step(self) -> None:
        for hook in self.step_hooks:
            hook.end()

    @torch.inference_mode()
    def _forward(self, plan: StepPlan, prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._page_in(plan)
        ids, pos, meta = self._inputs(plan, prev_ids)
        embeds = self._image_embeddings(ids, plan) if plan.image_rows else None
        set_attention_metadata(meta)
        if plan.lora_slots:
            cu = plan.cu_seqlens_q
            set_lora_segments(step_segments([(cu[i], n, slot) for i, (n, slot) in
                                             enumerate(zip(plan.num_new, plan.lora_slots))], self.device))
        try:
            if embeds is None:
                return self.model(ids, pos)
            if self.takes_image_mask:
                return self.model(ids, pos, inputs_embeds=embeds, image_mask=self._image_mask(ids, plan))
            return self.model(ids, pos, inputs_embeds=embeds)
        finally:
            set_attention_metadata(None)
            set_lora_segments(None)

    @staticmethod
    def _image_mask(ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """[T] bool: True on the step's image rows (``plan.image_rows``' spans)."""
        mask = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for row, _, _, count in plan.image_rows:
            mask[row:row + count] = True
        return mask

    def _image_embeddings(self, ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The step's input embeddings with the rows of image spans replaced by the vision
        encoder's rows: each image the step covers is encoded once (images of one shape in one
        batch through the tower)."""
        embeds = self.model.embed_input_ids(ids)
        cache = self._image_features
        found: dict[str, torch.Tensor] = {}
        by_shape: dict[tuple, dict[str, ImageInput]] = {}
        for image in plan.images:
            if image.digest in cache:
                cache.move_to_end(image.digest)
                found[image.digest] = cache[image.digest]
            else:  # one encoding per distinct image, however many sequences show it
                by_shape.setdefault((tuple(image.shape), image.dtype, tuple(image.grid)), {})[image.digest] = image
        for (_, _, grid), todo in by_shape.items():
            pixels = torch.stack([_pixels(im) for im in todo.values()]).to(self.device, self.dtype)
            for image, rows in zip(todo.values(), self.model.encode_images(pixels, [list(grid)] * len(todo))):
                if rows.shape[0] != image.length:
                    raise RuntimeError(f"the vision encoder gave {rows.shape[0]} rows for an image whose span "
                                       f"is {image.length} tokens: the tokenizer stage and the model "
                                       "disagree on this family's image size")
                found[image.digest] = cache[image.digest] = rows
                self._image_feature_rows += rows.shape[0]
                while self._image_feature_rows > IMAGE_FEATURE_ROWS and len(cache) > 1:
                    self._image_feature_rows -= cache.popitem(last=False)[1].shape[0]
        for row, index, src, count in plan.image_rows:
            embeds[row:row + count] = found[plan.images[index].digest][src:src + count].to(embeds.dtype)
        return embeds

    def _rope_shifts(self, seqs: list[Sequence]) -> list[int]:
        """Each decoding sequence's rotary position minus its index (a multimodal-rotary model's
        sequences after images); empty when all are 0."""
        if not self.mrope_merge or not any(s.images for s in seqs):
            return []
        return [mrope_delta(s.images, s.num_computed_tokens, self.mrope_merge) if s.images else 0 for s in seqs]

    def _graph_batch(self, out: SchedulerOutput) -> list[Sequence] | None:
        """The step's sequences when it can replay a decode graph (each brings one token), else None."""
        graphs = self.decode_graphs
        if not self.use_cuda_graphs or graphs is None:
            return None
        if any(item.num_new_tokens != 1 for item in out.scheduled):
            return None
        if self.kv_layout.centred and any(item.seq.num_computed_tokens == 0 for item in out.scheduled):
            return None  # a one-token prompt: its key centre is computed by an eager step, not in a graph
        seqs = [item.seq for item in out.scheduled]
        return seqs if graphs.can_run(seqs) else None

    def _plan(self, out: SchedulerOutput, prev: LaunchedStep | None) -> tuple[StepPlan, list[Sequence]]:
        """The step as a plan (host lists: what every rank needs to run it), and the sequences
        that sample, in the order of the plan's logit rows."""
        graph_seqs = self._graph_batch(out)
        if graph_seqs is not None:
            tokens, pending = self._decode_tokens(graph_seqs, prev)
            rows = [i for i, item in enumerate(out.scheduled) if item.samples]
            plan = StepPlan(StepKind.GRAPH, input_ids=tokens, positions=[s.num_computed_tokens for s in graph_seqs],
                            block_tables=[s.block_table for s in graph_seqs], pending=pending, logit_rows=rows,
                            rope_shifts=self._rope_shifts(graph_seqs))
            self._attach_lora(plan, graph_seqs)
            sampling = [out.scheduled[i].seq for i in rows]
        else:
            # Single-token sequences first, so that attention can split the batch (see _attention_metadata).
            items = sorted(out.scheduled, key=lambda item: item.num_new_tokens != 1)
            plan = self._flatten([(s.seq, s.num_new_tokens) for s in items], self.block_size, prev,
                                 mrope_merge=self.mrope_merge)
            self._attach_lora(plan, [item.seq for item in items])
            end = 0
            sampling = []
            for item in items:
                end += item.num_new_tokens
                if item.samples:
                    plan.logit_rows.append(end - 1)
                    sampling.append(item.seq)
        plan.num_sampled = len(sampling)
        # Decided here, before the forward, from what does not change by sampling time
        # (``plain_greedy``): the other ranks run the collectives the plan says.
        plan.vocab_argmax = self.tp.active and bool(sampling) and vocab_parallel_greedy(
            [s.params for s in sampling], [s.num_output_tokens for s in sampling])
        return plan, sampling

    def _execute(self, plan: StepPlan, prev_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Run a FORWARD or GRAPH plan on this rank; the logits of its ``logit_rows``, or for a
        ``vocab_argmax`` plan their argmax ids (on every rank); None when it has no such rows."""
        rows = plan.logit_rows
        if plan.kind == StepKind.GRAPH:
            self._page_in(plan)
            graphs = self.decode_graphs
            n = len(plan.input_ids)
            bs = graphs.stage(plan.input_ids, plan.positions, plan.block_tables, plan.rope_shifts, plan.lora_slots)
            out = graphs.run(bs, n, fill=lambda ids: self._gather_pending(ids, plan.pending, prev_ids))
            if not rows:
                return None
            out = out if len(rows) == n else out[self._to_device(rows, torch.int64)]
            return self._finish_head(out, plan) if graphs.split_head else out
        hidden = self._forward(plan, prev_ids)
        if not rows:
            return None
        return self._finish_head(self.model.head_shard(hidden[self._to_device(rows, torch.int64)]), plan)

    def _finish_head(self, shard: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The LM head's rows of this rank (``model.head_shard``) -> the step's logits, or for a
        ``vocab_argmax`` plan their argmax ids."""
        if plan.vocab_argmax:
            return self.model.argmax_from_shard(shard)
        return self.model.logits_from_shard(shard)

    def _send(self, plan: StepPlan) -> None:
        """Hand a plan to the other ranks (tensor parallel rank 0), before running it here."""
        if self.workers is not None:
            self.workers.send(plan)

    def _share_samples(self, token_ids: torch.Tensor | None, count: int) -> torch.Tensor | None:
        """Rank 0's sampled ids on every rank (a broadcast queued on the device, no sync): the
        next step's pending inputs read them. Returns them (allocated here off rank 0)."""
        if not self.tp.active or not count:
            return token_ids
        if token_ids is None:
            token_ids = torch.empty(count, dtype=torch.int64, device=self.device)
        return self.tp.broadcast(token_ids, src=0)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None = None,
               after_forward: Callable[[list[Sequence]], torch.Tensor | None] | None = None) -> LaunchedStep:
        """Queue one step (forward and sampling) on the device without waiting for it.

        ``prev`` is the step before, whose sampled ids this step's pending inputs read.
        ``after_forward`` is called with the sampling rows once the forward pass is queued and
        before sampling: the host works there while the device runs the forward. It returns the
        rows' output-constraint mask (host int32, ``engine/grammar.py``), or None."""
        plan, sampling = self._plan(out, prev)
        self._begin_step(graph=plan.kind == StepKind.GRAPH)
        self._send(plan)
        head = self._execute(plan, prev.samples.token_ids if prev is not None and prev.samples else None)
        # Counted before after_forward, which (Scheduler.launched) counts this step's own token
        # as pending: min_new_tokens and bad_sequences need the tokens generated before it.
        generated = [s.num_output_tokens for s in sampling]
        bitmask = after_forward(sampling) if after_forward is not None else None
        if not sampling:
            self._end_step()
            return LaunchedStep([], None)
        if plan.vocab_argmax:  # ``head`` holds the ids themselves, already on every rank
            assert bitmask is None, "a constrained row needs the whole row of logits"
            samples = DeviceSamples(head)
        else:
            samples = self._sample(head, sampling, generated, bitmask)
            self._share_samples(samples.token_ids, len(sampling))
        self._end_step()
        samples.start_copy()
        return LaunchedStep(sampling, samples)

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence], generated: list[int],
                bitmask: torch.Tensor | None) -> DeviceSamples:
        """The sampler's choices for the rows of ``logits`` (``sampling``'s sequences, in order,
        with ``generated`` tokens each before this one)."""
        if bitmask is not None and self.device.type == "cuda":  # pinned, so the copy does not wait
            bitmask = bitmask.pin_memory().to(self.device, non_blocking=True)
        return self.sampler.sample(
            logits,
            [s.params for s in sampling],
            [s.token_ids for s in sampling],
            generated,
            [s.sampling_seed for s in sampling],
            bitmask,
        )

    @torch.inference_mode()
    def follow(self, plan: StepPlan, prev_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Run rank 0's plan on this rank (tensor-parallel ranks 1..tp-1); returns the ids the
        step sampled (broadcast by rank 0, or the vocab-parallel argmax's, which every rank
        holds), which the next plan's pending inputs read."""
        if plan.kind == StepKind.ADAPTER:
            self._adapter_ops(plan.adapter_ops)
            return prev_ids
        if plan.kind == StepKind.SCORE:
            for _ in self._chunk_logits(self._forward(plan), len(plan.logit_rows)):
                pass  # the LM head's all-gather needs every rank; only rank 0 scores
            return prev_ids
        result = self._execute(plan, prev_ids)
        if plan.vocab_argmax:
            return result
        return self._share_samples(None, plan.num_sampled) if plan.num_sampled else prev_ids

    def _chunk_logits(self, hidden: torch.Tensor, rows: int):
        """The logits of ``hidden``'s first ``rows`` rows, ``_LOGIT_ROWS_PER_CHUNK`` at a time:
        yields (first row, logits)."""
        for lo in range(0, rows, _LOGIT_ROWS_PER_CHUNK):
            hi = min(lo + _LOGIT_ROWS_PER_CHUNK, rows)
            yield lo, self.model.compute_logits(hidden[lo:hi])

    @torch.inference_mode()
    def score_chunk(self, seq: Sequence, n: int) -> torch.Tensor:
        """Forward ``n`` more tokens of ``seq`` (blocks already allocated); returns the summed
        negative log-likelihood of each next token inside the chunk and the one after it."""
        start = seq.num_computed_tokens
        targets = seq.token_ids[start + 1 : start + n + 1]
        plan = self._flatten([(seq, n)], self.block_size, None, StepKind.SCORE, self.mrope_merge)
        plan.logit_rows = list(range(len(targets)))
        self._attach_lora(plan, [seq])
        self._send(plan)
        hidden = self._forward(plan)
        total = torch.zeros((), dtype=torch.float64)
        for lo, logits in self._chunk_logits(hidden, len(targets)):
            tgt = torch.tensor(targets[lo : lo + logits.shape[0]], device=logits.device)
            nll = torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="sum")
            total += nll.double().cpu()
        return total
