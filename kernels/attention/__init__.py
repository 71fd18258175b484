"""Attention over the paged KV cache for a flattened variable-length batch.

One entry point serves prefill, chunked prefill with a cached prefix, and decode: sequence ``b``
brings ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new queries, which are the *last*
``q_len`` positions of its ``seqlens_k[b]`` keys (already written to the cache). Masking is
causal with that offset. The Triton kernels (GPU) are checked against ``paged_attention_ref``.

Two Triton kernels sit behind :func:`paged_attention`, chosen by ``max_seqlen_q``:

* **decode** (every sequence brings one query): flash-decoding. Grid ``(kv_head, sequence,
  partition)``: each program reads one slice of one sequence's keys for one kv head, once, and
  scores it against all ``H / Hkv`` query heads of that group together (the group padded to a
  power of two >= 16 rows so it feeds ``tl.dot``). A quantized cache with one query a kv head
  (MHA) has its own kernel on the CUDA cores, one warp a program (``_decode_simt_kernel``).
  With more than one partition the programs write partial (output, log-sum-exp) pairs and a
  second kernel, grid ``(head, sequence)``, merges them; so a long context is spread over many
  programs even at batch 1.
  The number of partitions is fixed by the grid (sized on the host for ``max_seqlen_k``, which a
  CUDA graph fixes at the longest allowed context), but each sequence cuts its *own* length into
  that many slices (whole key tiles, at least ``min_part`` keys): a short context in a graph
  captured for 4k tokens still spreads over the partitions instead of leaving most programs
  idle. When the batch alone fills the GPU, ``min_part`` is the host's partition size, so short
  sequences keep one program each; a sequence that one partition covers writes its output
  directly and the merge kernel skips it.
* **prefill** (any ``q_len >= 1``, with or without a cached prefix): flash attention. Grid
  ``(query_tile, head, sequence)`` over ``cdiv(max_seqlen_q, BLOCK_M)`` query tiles; programs past
  their sequence's ``q_len`` return at once (no host-side tile list, so no device sync when the
  caller passes ``max_seqlen_q``). Key tiles after the tile's last query position are never read.

A latent cache (multi-head latent attention: one kv head of rows ``[c_kv, k_pe]``, the values a
view of their first ``kv_lora_rank`` columns) has its own decode and prefill kernels
(``mla.py``): every query head against the one row, each key tile read once for a block of
heads (decode) or of (token, head) rows (prefill), ``c_kv`` serving as keys and values.

All read keys through the block table token by token (a gather per key row), so any block size
works, including the one-token blocks of the attention layer's cache-less path. Softmax runs in
fp32 with exp2 (the scale is folded with log2(e)); outputs are cast to ``q.dtype``.

The package, one concern a module: ``reference`` (plain torch, CPU and tests), ``decode`` and
``prefill`` (the kernels), ``decode_quant`` (decode over a quantized cache: tensor-core walk and
CUDA-core kernel), ``mla`` (the latent cache's kernels and their launcher), ``tiles`` (the
key-tile step decode and prefill share), ``codes`` and ``ptx`` (reading quantized codes,
portable and inline PTX), ``centres`` (centred keys' scores), ``policy`` (``AttentionTuning``
and the launch heuristics), ``launch`` (the launcher and the dispatcher) and ``alibi`` (ALiBi's
slopes).

A layer's sliding window, soft-capping and ALiBi slopes are compile-time switches of every
kernel (``tiles._score_mods``: scale, then ALiBi, then the cap; the window a mask). With a window
decode reads only each sequence's last ``window`` keys, and prefill skips the key tiles before a
query tile's first window. A head dim that is not a power of two (Phi-3-mini's 96; 16 to 256 are
taken) is padded to the next one inside the kernels (``HEAD_PAD``): the dims past it load as 0
and are never stored, so a power-of-two head dim compiles to the same code as before.
"""

from .alibi import alibi_slopes
from .launch import paged_attention, paged_attention_triton
from .mla import paged_mla_triton
from .policy import AttentionTuning
from .reference import paged_attention_ref

__all__ = ["AttentionTuning", "alibi_slopes", "paged_attention", "paged_attention_ref", "paged_attention_triton",
           "paged_mla_triton"]
