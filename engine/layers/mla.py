"""Multi-head latent attention (MLA: DeepSeek-V2, V3, R1), attending over a cache of latents.

Per token the model projects one low-rank latent for keys and values, ``c_kv``
(``kv_a_proj_with_mqa``, then ``kv_a_layernorm``; ``kv_lora_rank`` wide), and one rotary key
``k_pe`` shared by every head (``qk_rope_head_dim``). Head h's key is ``[W_UK[h] c_kv, k_pe]`` and
its value ``W_UV[h] c_kv``, both taken from ``kv_b_proj``. The cache therefore holds one row a
token, ``[c_kv, rope(k_pe)]`` (576 values for DeepSeek-V2: 512 + 64), as one kv head, and no
value cache: the values are the row's first ``kv_lora_rank`` columns, a view
(``KVCacheSpec(1, kv_lora_rank + rope, kv_lora_rank, shares_v=True)``).

Every step (prefill, chunked prefill over a cached prefix, decode) attends in the absorbed form:
``W_UK`` is folded into the queries (``q_lat[h] = q_nope[h] @ W_UK[h]``, kv_lora_rank wide), so
query ``[q_lat, rope(q_pe)]`` against the latent rows scores exactly ``q_nope . k_nope + q_pe .
k_pe``; the attention runs as multi-query attention over the cache (``Attention`` with shared
values), and its per-head output in latent space is taken through ``W_UV`` before ``o_proj``.
Nothing is ever expanded to per-head keys or values, and the layer reads nothing back to the host.
On the GPU, decode and prefill run the MLA kernels of ``kernels/attention/mla.py`` (each latent
key tile loaded once for a block of heads; decode split over the keys, CUDA-graph capturable);
widths those kernels refuse fall back to ``paged_decode_torch`` for decode (plain torch, no host
sync) and the reference otherwise.

Tensor parallel: the query heads are split over the ranks (``q_proj`` / ``q_b_proj`` and
``kv_b_proj`` keep their heads' rows, ``o_proj`` its heads' inputs, one all-reduce); the latent
projection (``kv_a_proj_with_mqa``), the optional query down-projection (``q_a_proj``) and the
latent cache are the same on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..distributed import shard_range, tp_group
from .attention import Attention
from .linear import LinearBase, MergedLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding


def yarn_softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """The softmax scale: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` when RoPE is scaled and
    the scaling names ``mscale_all_dim`` (DeepSeek's YaRN: ``mscale = 0.1 * mscale_all_dim *
    ln(factor) + 1`` for factor > 1), as DeepSeek's own and transformers' attention compute it."""
    scale = qk_head_dim**-0.5
    scaling = rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return scale
    mscale_all_dim, factor = scaling.get("mscale_all_dim") or 0, float(scaling.get("factor") or 1.0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    """One MLA layer (the module doc): ``forward(positions, hidden) -> [T, hidden]``.

    ``rotary`` rotates the ``qk_rope_head_dim`` dims of ``q_pe`` and ``k_pe`` (DeepSeek pairs
    adjacent dims: an interleaved ``RotaryEmbedding``); ``scale`` is the softmax scale
    (``yarn_softmax_scale``). ``q_lora_rank`` None: ``q_proj`` straight from the hidden state;
    else ``q_b_proj(rmsnorm(q_a_proj(x)))``. ``bias``: the biases of ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and ``o_proj`` (config.json's ``attention_bias``). The module names
    are the checkpoints' (``self_attn.kv_b_proj.weight`` ...).
    """

    def __init__(
        self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
        v_head_dim: int, rotary: RotaryEmbedding, scale: float, rms_norm_eps: float,
        q_lora_rank: int | None = None, bias: bool = False,
    ) -> None:
        super().__init__()
        if rotary.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"the rotary table rotates {rotary.rotary_dim} dims, q_pe/k_pe have {qk_rope_head_dim}")
        tp = tp_group()
        self.num_heads = shard_range(num_heads, tp.rank, tp.size, "num_attention_heads")[1]  # this rank's
        self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = (kv_lora_rank, qk_nope_head_dim,
                                                                       qk_rope_head_dim, v_head_dim)
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        # One output projection each: MergedLinear splits its rows evenly over the ranks, i.e. by heads.
        if q_lora_rank is None:
            self.q_proj = MergedLinear(hidden_size, [num_heads * qk_head_dim])
        else:
            self.q_a_proj = LinearBase(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps)
            self.q_b_proj = MergedLinear(q_lora_rank, [num_heads * qk_head_dim])
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = LinearBase(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = MergedLinear(kv_lora_rank, [num_heads * (qk_nope_head_dim + v_head_dim)])
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.rotary_emb = rotary
        # Multi-query attention over the latent rows: one kv head, values its first kv_lora_rank columns.
        self.attn = Attention(self.num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale, v_head_dim=kv_lora_rank)

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> this rank's queries [T, H, qk_nope + qk_rope]."""
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.nope_dim + self.rope_dim)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s weight as (W_UK [H, qk_nope, kv_lora_rank], W_UV [H, v_head_dim,
        kv_lora_rank]): views, the rows of each head being its key part then its value part."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; stores this step's latent rows in the cache."""
        q_nope, q_pe = self._queries(hidden).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        w_uk, w_uv = self._up_projections()
        # Absorb W_UK into the queries: [H, T, nope] @ [H, nope, C] -> [T, H, C].
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_lat, q_pe], dim=-1)
        latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, C + rope]: the cached row
        out = self.attn(query, latent, None).view(-1, self.num_heads, self.kv_lora_rank)
        # Each head's output in latent space through its W_UV: [H, T, C] @ [H, C, v] -> [T, H * v].
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))
