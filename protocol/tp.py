"""What the tensor-parallel rank 0 (the engine) tells the other ranks, and what they tell it.

Rank 0 schedules; each step it sends every other rank one ``StepPlan``: the flattened batch as
host lists, everything a rank needs to run the same forward on its shard of the model. The
ranks' only answer on the hot path is taking part in the step's collectives; ``RankStatus``
(ready, alive, failed) goes back on a separate socket that rank 0's watchdog reads.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from .multimodal import ImageInput

_TAG = dict(tag_field="t", array_like=True, omit_defaults=True)


class StepKind(IntEnum):
    """What a plan asks a rank to do."""

    FORWARD = 0  # an eager forward of a flattened batch, then the logits of some rows
    GRAPH = 1  # a decode step replayed from the captured CUDA graph of its padded size
    SCORE = 2  # a forward, then the logits of every row in chunks (get_ppl)
    STOP = 3  # leave the loop and exit
    ADAPTER = 4  # register or forget LoRA adapters (``adapter_ops``); no forward


class StepPlan(msgspec.Struct, tag=1, **_TAG):
    """One step's inputs. ``pending``: (input row, row of the previous step's sampled ids) for
    each input token still on the device; ``logit_rows``: the rows whose logits are computed;
    ``num_sampled``: how many ids rank 0 broadcasts after sampling (the next step's pending
    inputs read them); ``vocab_argmax``: every sampled row is plain greedy, so each rank takes
    the argmax of its vocabulary shard and the ranks exchange (value, index) pairs instead: no
    logits gathered, no sampler, no broadcast, every rank ends with the ids
    (``engine/layers/vocab_argmax.py``); ``centre_rows`` / ``new_centres``: a quantized cache's
    key centres (``kernels/kv_cache.KeyCentring``). FORWARD/SCORE use every field; GRAPH only
    ``input_ids``, ``positions``, ``block_tables``, ``pending``, ``logit_rows``, ``num_sampled``
    and ``vocab_argmax``."""

    kind: StepKind
    input_ids: list[int] = []
    positions: list[int] = []
    block_tables: list[list[int]] = []
    slots: list[int] = []
    cu_seqlens_q: list[int] = []
    seqlens_k: list[int] = []
    num_new: list[int] = []
    pending: list[tuple[int, int]] = []
    logit_rows: list[int] = []
    num_sampled: int = 0
    vocab_argmax: bool = False
    centre_rows: list[int] = []  # each token's sequence's first block: its key centre's row
    new_centres: list[tuple[int, int, int]] = []  # (first token, tokens, row) of sequences starting here
    # The images whose spans this step's chunks cover, and (input row, index in ``images``,
    # encoder row, rows) of each covered run: a vision model's encoder rows replace those
    # inputs' embeddings (``engine/multimodal.py``). FORWARD only.
    images: list[ImageInput] = []
    image_rows: list[tuple[int, int, int, int]] = []
    # A multimodal-rotary model's (Qwen2-VL) positions: ``[3, T]`` rows (temporal, row, column)
    # when the step computes image tokens, else ``positions`` alone (FORWARD / SCORE); a GRAPH
    # step's rotary position of each row minus its index (``positions``), empty when all are 0.
    mrope_positions: list[list[int]] = []
    rope_shifts: list[int] = []
    # LoRA (``engine/lora/``): each sequence's (FORWARD / SCORE, in ``num_new`` order) or row's
    # (GRAPH) adapter slot, -1 for none, empty when no sequence runs an adapter; the (adapter id,
    # slot) pages to copy in before the step; an ADAPTER plan's (adapter id, name, path) to
    # register, or with path "" to forget.
    lora_slots: list[int] = []
    lora_loads: list[tuple[int, int]] = []
    adapter_ops: list[tuple[int, str, str]] = []


class RankStatus(msgspec.Struct, tag=2, **_TAG):
    """A rank's news for rank 0: ``state`` "joining" (about to join the process group), "ready"
    (its model and cache are built), "alive" (a heartbeat, sent every ``HEARTBEAT_S``) or
    "failed" (``error``)."""

    rank: int
    state: str
    pid: int = 0
    error: str = ""


HEARTBEAT_S = 0.5

RankIn = StepPlan
RankOut = RankStatus
