"""CUDA graphs for decode steps, captured at a ladder of batch sizes and replayed with padding.

A decode step launches hundreds of small kernels (about a dozen per layer); at small batches the
GPU finishes each faster than Python can launch the next, so the step is launch-bound. Capturing
the whole forward (and the LM head) once per batch size and replaying it costs one launch.

A graph replays fixed pointers and a fixed launch grid, so everything it reads lives in static
buffers sized for the largest captured batch, and the attention kernels are captured with fixed
upper bounds (``max_seqlen_q = 1``, ``max_seqlen_k`` = the longest sequence the engine allows).
A step of ``n`` sequences replays the smallest captured size ``bs >= n``; rows ``n..bs`` are
padding: token 0 at position 0, slot ``-1`` (``store_kv`` skips negative slots, so a padded row
never writes the cache) and one key read from block 0 (any existing block: it is only read, and
the padded rows' outputs are discarded). Rows are independent in every layer (matmuls, norms,
attention per sequence), so padding cannot change the real rows' results.

Inputs are written on the host into pinned buffers and copied with ``non_blocking``; an event
recorded after the copies guards the pinned buffers against being rewritten before the copy
has read them.

With a LoRA pool (``lora_slots`` > 0) every size is captured twice: once without adapters (the
graph a step with no adapter token replays: it costs nothing more than without LoRA), and once
with the adapter kernels reading static segment buffers (``kernels/lora.LoRASegments``: each
row's slot, grouped; a padding segment has slot -1 and is skipped), which ``stage`` fills.

Under tensor parallel (``split_head``) the graphs end at each rank's rows of the LM head's
product (``model.head_shard``), before any collective on the vocabulary, and the step finishes
after the replay: all-gathering the logits for the sampler, or, when every row is plain greedy,
the vocab-parallel argmax (``layers/vocab_argmax.py``), as rank 0's plan says. The finish is a
few small kernels and one collective; capturing both finishes instead would capture every size
twice (twice the capture time, a second set of graphs and static outputs) to save those few
launches. The split also gathers only the rows that sample, not the padding, and each graph's
static output is this rank's rows in the weights' dtype, not the float32 vocabulary.

The same class runs without graphs (``capture=False``): the model is then called eagerly on the
padded static buffers, which lets the CPU tests exercise the padding logic.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence as Seq

import torch
from torch import nn

from ..kernels.lora import LoRASegments
from .attention_metadata import AttentionMetadata, set_attention_metadata
from .layers.lora import set_lora_segments
from .lora.segments import group_rows
from .sequence import Sequence

logger = logging.getLogger(__name__)

# Batch sizes captured by default; padding to the next one wastes little because decode at these
# sizes is bound by reading the weights, not by the rows.
DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch_size: int, cap: int = MAX_GRAPH_BATCH) -> list[int]:
    """The ladder of sizes to capture: DEFAULT_LADDER up to ``min(max_batch_size, cap)``, plus that bound."""
    top = min(max_batch_size, cap)
    sizes = [s for s in DEFAULT_LADDER if s <= top]
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Static decode buffers plus one captured graph per batch size of the ladder."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_seqlen_k: int,
        block_size: int,
        device: torch.device,
        capture: bool,
        lora_slots: int = 0,
        split_head: bool = False,
    ) -> None:
        self.model = model
        self.split_head = split_head
        self.device = device
        self.block_size = block_size
        self.max_seqlen_k = max_seqlen_k
        self.max_blocks = max_blocks_per_seq
        self.sizes = graph_batch_sizes(max_batch_size)
        self.captured = False
        top = self.sizes[-1]
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, pin_memory=pin)

        # Host staging (pinned on CUDA) and their numpy views, which are fast to fill row by row.
        self._h_ids = host((top,), torch.int64, 0)
        self._h_pos = host((top,), torch.int64, 0)
        self._h_slots = host((top,), torch.int64, -1)
        self._h_lens = host((top,), torch.int32, 1)
        self._h_tables = host((top, self.max_blocks), torch.int32, 0)  # block 0: the padding rows' key
        self._np = [t.numpy() for t in (self._h_ids, self._h_pos, self._h_slots, self._h_lens)]
        self._np_tables = self._h_tables.numpy()
        # Device buffers the graphs read. cu_seqlens_q never changes: one query per row.
        self.input_ids = self._h_ids.to(device)
        self.positions = self._h_pos.to(device)
        self.slot_mapping = self._h_slots.to(device)
        self.seqlens_k = self._h_lens.to(device)
        self.block_tables = self._h_tables.to(device)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=device)
        # LoRA: [row order (top) | segment starts (slots + 1) | segment slots (slots)], one copy.
        self.lora_slots = lora_slots
        self._h_lora = host((top + 2 * lora_slots + 1,), torch.int32, -1) if lora_slots else None
        self._lora = self._h_lora.to(device) if lora_slots else None
        self._lora_staged = False
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        if capture:
            self.capture()

    # ---- choosing and staging a batch --------------------------------------------------------

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` replays, or None when it is too large."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, seqs: Seq[Sequence]) -> bool:
        """Whether these sequences (each decoding one token) fit the static buffers."""
        if not seqs or self.padded_size(len(seqs)) is None:
            return False
        return all(
            len(s.block_table) <= self.max_blocks and s.num_computed_tokens < self.max_seqlen_k for s in seqs
        )

    def stage(self, tokens: Seq[int], positions: Seq[int], block_tables: Seq[Seq[int]],
              rope_shifts: Seq[int] = (), lora_slots: Seq[int] = ()) -> int:
        """Write the host-side inputs of one decode step (row ``i``: ``tokens[i]`` at position
        ``positions[i]`` of the sequence whose block table is ``block_tables[i]``, rotated at
        that position + ``rope_shifts[i]`` when given: a multimodal rotary's text after images;
        with the LoRA adapter in pool slot ``lora_slots[i]`` when given, -1: none); returns the
        padded batch size. No device work happens here."""
        n = len(tokens)
        bs = self.padded_size(n)
        assert bs is not None, "stage() needs a batch that can_run() accepted"
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the pinned buffers
        ids, pos, slots, lens = self._np
        tables, block = self._np_tables, self.block_size
        ids[:n] = tokens
        for i, (p, table) in enumerate(zip(positions, block_tables)):
            pos[i] = p + rope_shifts[i] if rope_shifts else p
            slots[i] = table[p // block] * block + p % block
            lens[i] = p + 1
            tables[i, : len(table)] = table
        # Padding rows: no cache write, one key read from block 0.
        ids[n:bs] = 0
        pos[n:bs] = 0
        slots[n:bs] = -1
        lens[n:bs] = 1
        tables[n:bs, 0] = 0
        self._lora_staged = bool(lora_slots)
        if lora_slots:
            self._stage_lora(lora_slots)
        return bs

    def _stage_lora(self, row_slots: Seq[int]) -> None:
        """The rows grouped by adapter slot into the LoRA buffer; unused segments are padding."""
        order, starts, slots = group_rows([(row, 1, slot) for row, slot in enumerate(row_slots)])
        buf, top, s = self._h_lora.numpy(), self.sizes[-1], self.lora_slots
        buf[:len(order)] = order
        buf[top:top + len(starts)] = starts
        buf[top + len(starts):top + s + 1] = starts[-1]  # empty padding segments
        buf[top + s + 1:top + s + 1 + len(slots)] = slots
        buf[top + s + 1 + len(slots):] = -1

    def lora_segments(self, bs: int) -> LoRASegments:
        """The static LoRA segments of a ``bs``-row step (device views)."""
        top, s = self.sizes[-1], self.lora_slots
        return LoRASegments(self._lora[:top], self._lora[top:top + s + 1], self._lora[top + s + 1:], bs)

    def _copy_inputs(self, bs: int) -> None:
        nb = self.device.type == "cuda"
        self.input_ids[:bs].copy_(self._h_ids[:bs], non_blocking=nb)
        self.positions[:bs].copy_(self._h_pos[:bs], non_blocking=nb)
        self.slot_mapping[:bs].copy_(self._h_slots[:bs], non_blocking=nb)
        self.seqlens_k[:bs].copy_(self._h_lens[:bs], non_blocking=nb)
        self.block_tables[:bs].copy_(self._h_tables[:bs], non_blocking=nb)
        if self._lora_staged:
            self._lora.copy_(self._h_lora, non_blocking=nb)
        if self._copied is not None:
            self._copied.record()

    # ---- running -----------------------------------------------------------------------------

    def metadata(self, bs: int) -> AttentionMetadata:
        """Attention metadata over the first ``bs`` rows of the static buffers (fixed upper bounds)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seqlens_k=self.seqlens_k[:bs],
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
            # A decoding sequence's key centre is at its first block's row (a centred cache:
            # KVCacheLayout.centred); none is computed here, as none starts in a graph step.
            centre_index=self.block_tables[:bs, 0],
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        return self.model.head_shard(hidden) if self.split_head else self.model.compute_logits(hidden)

    def run(self, bs: int, num_rows: int, fill=None) -> torch.Tensor:
        """Copy the staged inputs and replay (or, uncaptured, run) size ``bs``, with the LoRA
        kernels when the step staged adapter slots; returns the ``[num_rows, vocab]`` float32
        logits, or with ``split_head`` this rank's ``[num_rows, rows]`` of the LM head's product
        (``model.logits_from_shard`` / ``argmax_from_shard`` finish them). They live in a static
        buffer: consume them before the next call.
        ``fill(input_ids)``, when given, edits the device input ids after the copy (the runner
        writes pending tokens there from the previous step's ids)."""
        self._copy_inputs(bs)
        if fill is not None:
            fill(self.input_ids)
        key = (bs, self._lora_staged)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return self._outputs[key][:num_rows]
        set_attention_metadata(self.metadata(bs))
        set_lora_segments(self.lora_segments(bs) if self._lora_staged else None)
        try:
            return self._forward(bs)[:num_rows]
        finally:
            set_attention_metadata(None)
            set_lora_segments(None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per ladder size, largest first, all sharing one memory pool."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        # Every row is padding while capturing: nothing is written to the cache, and every LoRA
        # segment is empty.
        self._reset_padding()
        for bs in reversed(self.sizes):
            for lora in (False, True) if self.lora_slots else (False,):
                set_attention_metadata(self.metadata(bs))
                set_lora_segments(self.lora_segments(bs) if lora else None)
                try:
                    # An eager run first: Triton compiles and loads its kernels for these shapes
                    # here, outside the capture (module loading cannot be captured).
                    self._forward(bs)
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(bs)
                finally:
                    set_attention_metadata(None)
                    set_lora_segments(None)
                self._graphs[(bs, lora)] = graph
                self._outputs[(bs, lora)] = out
        torch.cuda.synchronize(self.device)
        self.captured = True
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def release(self, wait: bool = True) -> None:
        """Free every graph (and their pool's memory); ``run`` is no longer possible. Without
        ``wait``, a replay still running is not waited for (after a tensor-parallel failure, one
        may wait on a dead peer forever; nothing reads what it writes)."""
        if wait and self.device.type == "cuda":  # the uncaptured buffers (CPU tests) have nothing in flight
            torch.cuda.synchronize(self.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
        self.captured = False

    def _reset_padding(self) -> None:
        """Make every row of the device buffers a padding row."""
        top = self.sizes[-1]
        ids, pos, slots, lens = self._np
        ids[:top], pos[:top], slots[:top], lens[:top] = 0, 0, -1, 1
        self._np_tables[:top] = 0
        self._lora_staged = self._h_lora is not None
        if self._lora_staged:
            self._stage_lora([])  # no row in any segment
        self._copy_inputs(top)
        self._lora_staged = False
        if self._copied is not None:
            self._copied.synchronize()
