"""Per-step attention metadata, set by the model runner and read by every attention layer.

A context object rather than forward() arguments so model files stay plain torch modules
(nano-vllm's pattern): the runner sets it before the forward and clears it after.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where the flattened batch's tokens sit in the paged KV cache.

    ``T`` tokens from ``B`` sequences; sequence b owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, which are the last positions of its ``seqlens_k[b]``
    keys. ``slot_mapping[t]`` is the flat cache slot (``block * block_size + offset``) token t
    is written to. A centred cache (``KVCacheLayout.centred``) also takes ``centre_index`` (token
    t's sequence's key centre row, its first block) and ``new_centres`` (the sequences whose first
    chunk this step writes): ``kernels/kv_cache.KeyCentring``.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seqlens_k: torch.Tensor  # [B] int32
    max_seqlen_q: int
    max_seqlen_k: int
    centre_index: torch.Tensor | None = None  # [T] (any stride)
    new_centres: torch.Tensor | None = None  # [S, 3] int32 (first token, tokens, row)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.max_seqlen_q == 1


# Thread-local: several engines (each stepping in its own thread) may share one process.
_local = threading.local()


def set_attention_metadata(meta: AttentionMetadata | None) -> None:
    """Install the metadata for the forward about to run (None clears it)."""
    _local.meta = meta


def get_attention_metadata() -> AttentionMetadata:
    """The metadata of the running forward; an attention layer called outside one is a bug."""
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("attention called outside a model-runner step (no AttentionMetadata set)")
    return meta
