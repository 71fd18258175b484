"""Llama decoder (also Mistral, and the base the Qwen2/InternLM2 models subclass).

Projections are fused (``qkv_proj``, ``gate_up_proj``); ``load_weights`` splits Hugging Face's
separate ``q/k/v_proj`` and ``gate/up_proj`` tensors into them. Subclasses change only the bias
flags and ``map_weight`` (checkpoint name -> parameter name and shard).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...protocol.errors import UnsupportedModelError
from ..layers import (
    Attention,
    LMHead,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RowParallelLinear,
    RotaryEmbedding,
    VocabEmbedding,
    act_and_mul,
    get_rope,
)
from ..layers.linear import ShardId
from ..layers.qk_norm import QKNorm
from ..attention_windows import layer_windows
from ..distributed import tp_group
from ..model_config import ModelConfig
from ..weight_loader import materialize

logger = logging.getLogger(__name__)

WeightTarget = tuple[str, ShardId | None, torch.Tensor]

# Checkpoint tensors that carry no parameters (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_MAX_LISTED = 20


def linear_method(config: ModelConfig):
    """A fresh LinearMethod for one decoder linear: the checkpoint's quantized format, or dense."""
    return config.quant.linear_method() if config.quant is not None else None


def hands_over_int8(config: ModelConfig) -> bool:
    """Whether the norms before q/k/v and gate/up, and the MLP's gate before down_proj, hand their
    output over quantized (W8A8 linears read int8)."""
    return config.quant is not None and config.quant.takes_int8_input


@dataclass(frozen=True)
class LlamaVariant:
    """What a family changes in the Llama computation besides biases and weight names (the
    family's ``variant(config)`` builds it): the MLP's gate activation (a ``hidden_act`` name),
    the offset its RMSNorm checkpoints leave out (Gemma stores ``weight - 1``), and the factor
    the embedding rows are multiplied by (Gemma: ``sqrt(hidden_size)``)."""

    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    embed_scale: float = 1.0
    # RMSNorm of q and k before rotary: None, "per_head" (Qwen3) or "full" (OLMo 2); layers/qk_norm.py.
    qk_norm: str | None = None
    # The decoder block's class (same constructor as LlamaDecoderLayer); None: Llama's pre-norm block.
    decoder_layer: type[nn.Module] | None = None
    # Each layer's sliding window (engine/attention_windows.py; empty or None: full attention).
    layer_windows: tuple[int | None, ...] = ()
    # The softmax scale (None: head_dim ** -0.5; Gemma 2/3: query_pre_attn_scalar ** -0.5) and the
    # soft-caps of the attention scores and of the final logits (Gemma 2: c * tanh(x / c)).
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # The offset the q/k norms' checkpoints leave out (Gemma 3 stores ``weight - 1`` there too).
    qk_norm_offset: float = 0.0

    def window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, None for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE, paged attention, output projection; under tensor parallel,
    this rank's heads (``QKVLinear`` picks them) and its part of o_proj's inputs."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        variant = variant or LlamaVariant()
        h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, d, h, hkv, bias=qkv_bias, method=linear_method(config))
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, bias=o_bias, method=linear_method(config))
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, variant.attn_scale,
                              sliding_window=variant.window(layer_idx), softcap=variant.attn_softcap)
        self.q_norm = self.k_norm = None
        if variant.qk_norm is not None:
            eps, offset = config.rms_norm_eps, variant.qk_norm_offset
            self.q_norm = QKNorm(variant.qk_norm, self.num_heads, d, eps, offset)
            self.k_norm = QKNorm(variant.qk_norm, self.num_kv_heads, d, eps, offset)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.rotary_emb.fused:  # partial or interleaved RoPE: rotated in torch (layers/rotary.py)
            q, k = self.rotary_emb(positions, q, k)
            return self.o_proj(self.attn(q, k, v))
        # RoPE is applied inside attention, fused with the KV-cache write (kernels/kv_cache.py).
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb.cos_sin_cache))


class LlamaMLP(nn.Module):
    """Gated MLP (SwiGLU, or the variant's activation) over a fused gate/up projection."""

    def __init__(self, config: ModelConfig, bias: bool, variant: LlamaVariant | None = None) -> None:
        super().__init__()
        act = (variant or LlamaVariant()).hidden_act
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias, method=linear_method(config))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, method=linear_method(config))
        self.act = act_and_mul(act, quantize_output=hands_over_int8(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual add is fused into the next norm. A family whose
    attention differs (same constructor) subclasses it and sets ``attention_class``."""

    attention_class: type[nn.Module] = LlamaAttention

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        variant = variant or LlamaVariant()
        self.self_attn = self.attention_class(config, rotary, qkv_bias, o_bias, variant, layer_idx)
        self.mlp = LlamaMLP(config, mlp_bias, variant)
        quantize, offset = hands_over_int8(config), variant.norm_weight_offset
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, quantize, offset)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's output, residual stream before it); their sum is the true hidden state."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack, final norm. ``sliding_rotary``, when given, is the RoPE of the
    sliding-window layers (Gemma 3 rotates those with another base than its global layers)."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
        variant: LlamaVariant | None = None, sliding_rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        variant = variant or LlamaVariant()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale=variant.embed_scale)
        layer_class = variant.decoder_layer or LlamaDecoderLayer

        def rotary_of(i: int) -> RotaryEmbedding:
            return sliding_rotary if sliding_rotary is not None and variant.window(i) is not None else rotary

        self.layers = nn.ModuleList(
            layer_class(config, rotary_of(i), qkv_bias, o_bias, mlp_bias, variant, layer_idx=i)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_offset=variant.norm_weight_offset)
        self._fuse_all_reduces()

    def _fuse_all_reduces(self) -> None:
        """Tensor parallel's "fused" all-reduce: where every layer is Llama's own block (o_proj's
        sum goes straight into post_attention_layernorm, down_proj's into the next layer's
        input_layernorm or the final norm, all plain RMSNorms), the row-parallel linears leave
        their parts for those norms to sum. Any other block keeps the all-reduce in the linear."""
        fused = tp_group().fused
        if fused is None:
            return
        sites = []
        for layer in self.layers:
            plain = (type(layer).forward is LlamaDecoderLayer.forward
                     and type(layer.self_attn).forward is LlamaAttention.forward
                     and type(layer.mlp).forward is LlamaMLP.forward
                     and not layer.input_layernorm.quantize_output
                     and not layer.post_attention_layernorm.quantize_output)
            if not plain:
                logger.warning("tp_all_reduce='fused': %s is not Llama's block, so its all-reduces take NCCL",
                               type(layer).__name__)
                return
            sites += [layer.self_attn.o_proj, layer.mlp.down_proj]
        if not fused.assign(sites):
            logger.warning("tp_all_reduce='fused': no ring of slots fits %d sums a forward, so they take NCCL",
                           len(sites))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final-normed hidden states; ``inputs_embeds``
        (a vision model's, image rows written in) stand for the ids' embeddings."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama causal LM with the engine's model interface (forward / compute_logits / load_weights)."""

    # Hugging Face projection name -> (fused parameter, shard id).
    stacked_params: tuple[tuple[str, str, ShardId], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(
        self, config: ModelConfig, rope_scaling_factor: float = 0.0, max_position: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        rotary = self.rope(config, rope_scaling_factor, max_position)
        qkv_bias, o_bias = self.attention_biases(config)
        variant = self.variant(config)
        self.final_softcap = variant.final_softcap
        self.model = LlamaModel(config, rotary, qkv_bias, o_bias, self.mlp_bias(config), variant,
                                self.sliding_rotary(config, rope_scaling_factor, max_position))
        tie = self.model.embed_tokens if self.ties_embeddings(config) else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tie)

    @staticmethod
    def rope(config: ModelConfig, rope_scaling_factor: float, max_position: int | None) -> RotaryEmbedding:
        """The family's RoPE (GLM and Phi-4-mini: partial, GLM's in interleaved pairs)."""
        return get_rope(config, rope_scaling_factor, max_position)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias); Llama's ``attention_bias`` covers both."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def mlp_bias(config: ModelConfig) -> bool:
        """Whether gate/up/down carry a bias (Llama's ``mlp_bias``)."""
        return bool(config.raw.get("mlp_bias", False))

    @staticmethod
    def variant(config: ModelConfig) -> LlamaVariant:
        """The family's changes to the Llama computation; Llama's MLP takes ``hidden_act``, and
        each layer the sliding window config.json gives it (engine/attention_windows.py)."""
        return LlamaVariant(hidden_act=config.raw.get("hidden_act", config.raw.get("hidden_activation", "silu")),
                            layer_windows=layer_windows(config.raw, config.num_layers))

    @staticmethod
    def sliding_rotary(config: ModelConfig, rope_scaling_factor: float, max_position: int | None
                       ) -> RotaryEmbedding | None:
        """The RoPE of the sliding-window layers where it differs from the others (Gemma 3); None: the same."""
        return None

    @staticmethod
    def ties_embeddings(config: ModelConfig) -> bool:
        """Whether the LM head reuses the input embedding (config.json's ``tie_word_embeddings``)."""
        return config.tie_word_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids and positions of a flattened batch -> [T, hidden]; reads the attention metadata.
        ``inputs_embeds``: the ids' embeddings given (a vision-language model's)."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (soft-capped where the family caps them: Gemma 2)."""
        return self.logits_from_shard(self.head_shard(hidden_rows))

    def head_shard(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, rows]: this rank's rows of the LM head's product, before any
        collective (the decode graphs end here under tensor parallel, engine/cuda_graph.py); the
        whole vocabulary at tp=1. ``logits_from_shard`` or ``argmax_from_shard`` finish it."""
        return self.lm_head.shard(hidden_rows)

    def logits_from_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """``head_shard``'s rows -> the [N, vocab] float32 logits ``compute_logits`` gives."""
        return self._soft_capped(self.lm_head.gather(shard))

    def argmax_from_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """``head_shard``'s rows -> [N] int64: the argmax of ``logits_from_shard``'s rows, bit for
        bit, without gathering them (layers/vocab_argmax.py); a collective under tensor parallel.
        The cap is taken on the shard, before the argmax: in float32 it can make distinct logits
        equal, and the tie is then the lowest index's, as on the gathered row."""
        return self.lm_head.argmax(self._soft_capped(shard.float()))

    def _soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def attention_layers(self) -> list[Attention]:
        """Each layer's Attention in order, for the runner to assign ``k_cache``/``v_cache``."""
        return [layer.self_attn.attn for layer in self.model.layers]

    # ---- weight loading ---------------------------------------------------------------------

    def map_weight(self, name: str, tensor: torch.Tensor) -> Iterator[WeightTarget]:
        """Checkpoint tensor -> the (parameter name, shard id, tensor) pieces it fills."""
        for fused, hf_name, shard in self.stacked_params:
            if f".{hf_name}." in name:
                yield name.replace(f".{hf_name}.", f".{fused}."), shard, tensor
                return
        yield name, None, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; raise if any parameter (or fused shard) stays unloaded."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, ShardId | None]] = set()
        unexpected: list[str] = []
        saw_lm_head = False
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.config.quant is not None and self.config.quant.skips_tensor(ckpt_name, tensor):
                continue
            for name, shard, piece in self.map_weight(ckpt_name, tensor):
                if name == "lm_head.weight":
                    saw_lm_head = True
                    if self.lm_head.tied:
                        continue  # tied: the embedding provides it (Hugging Face does the same)
                param = params.get(name)
                if param is None:
                    unexpected.append(ckpt_name)
                    continue
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    loader(param, piece, shard)
                elif shard is not None:
                    raise ValueError(f"{name} is not fused but got shard {shard!r} from {ckpt_name}")
                else:
                    if param.shape != piece.shape:
                        raise ValueError(
                            f"checkpoint tensor {ckpt_name} has shape {tuple(piece.shape)}, "
                            f"expected {tuple(param.shape)} for {name}"
                        )
                    param.data.copy_(materialize(piece))
                loaded.add((name, shard))
        if not self.lm_head.tied and not saw_lm_head and ("model.embed_tokens.weight", None) in loaded:
            logger.info("checkpoint has no lm_head.weight: using the input embedding (tied)")
            self.lm_head.weight.data.copy_(self.model.embed_tokens.weight.data)
            loaded.add(("lm_head.weight", None))
        self._check_complete(params, loaded, unexpected)

    @staticmethod
    def _check_complete(
        params: dict[str, nn.Parameter], loaded: set[tuple[str, ShardId | None]], unexpected: list[str]
    ) -> None:
        missing = []
        for name, param in params.items():
            shards = getattr(param, "shard_ids", None)
            if (name, None) in loaded:
                continue
            if shards is None:
                missing.append(name)
            else:
                missing += [f"{name}[{s}]" for s in shards if (name, s) not in loaded]

        def listing(names: list[str]) -> str:
            more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
            return ", ".join(names[:_MAX_LISTED]) + more

        problems = []
        if missing:
            problems.append(f"missing parameters ({len(missing)}): {listing(missing)}")
        if unexpected:
            problems.append(f"unexpected checkpoint tensors ({len(unexpected)}): {listing(unexpected)}")
        if problems:
            raise UnsupportedModelError(
                "checkpoint does not match the model: " + "; ".join(problems)
                + ". Check that config.json matches the weights (architecture, layer count, biases)."
            )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout; v0.1's sliding window (every layer) comes with Llama's ``variant``."""
