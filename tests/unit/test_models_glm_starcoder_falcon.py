"""GLM / GLM-4 / ChatGLM, StarCoder2, Falcon and Phi-4-mini's partial rotary against transformers:
tiny random models built with transformers' own config classes, saved with ``save_pretrained``
(or, for ChatGLM, converted to THUDM's checkpoint layout), loaded by the engine; logits (CPU,
float32) and greedy tokens must match. The helpers are test_models.py's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models import (
    TINY,
    check_chunked_prefill,
    check_greedy_matches_generate,
    check_prefill_then_decode,
    check_prefills,
    check_triton_kernels,
    check_two_sequence_batch,
    PagedCache,
    assert_close,
    hf_logits,
    load_ours,
    random_tokens,
    save_tiny,
)
from transformers import AutoModelForCausalLM, FalconConfig, Glm4Config, GlmConfig, Phi3Config, Starcoder2Config

from conveyor.engine.model_config import ModelConfig
from conveyor.engine.models import build_model
from conveyor.protocol.errors import EngineConfigError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_ROT = 12 // 2  # Phi-4-mini style: 0.75 of a 16-dim head rotated; longrope factors per rotated pair
FALCON = dict(hidden_size=64, ffn_hidden_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
              max_position_embeddings=256, **IDS)


def _configs() -> dict[str, object]:
    return {
        # Half of each 16-dim head rotated, in interleaved pairs; q/k/v bias, GQA 4/2.
        "glm": GlmConfig(**TINY, head_dim=16, **IDS),
        # GLM-4-0414: post-attention and post-MLP norms; MQA, no bias, tied head.
        "glm4_mqa_tied": Glm4Config(**{**TINY, "num_key_value_heads": 1}, head_dim=16, attention_bias=False,
                                    tie_word_embeddings=True, **IDS),
        # Converted to THUDM's ChatGLM layout (to_chatglm); RoPE base 10000 * rope_ratio 5.
        "chatglm": GlmConfig(**TINY, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                                                                   "partial_rotary_factor": 0.5}, **IDS),
        # LayerNorms with bias, GELU-tanh c_fc/c_proj, biases everywhere, a window of 8 on every
        # layer (prompts here run to 30 tokens), tied head.
        "starcoder2_window8": Starcoder2Config(**TINY, sliding_window=8, **IDS),
        # No biases, untied head, MQA, no window.
        "starcoder2_untied_nobias_mqa": Starcoder2Config(**{**TINY, "num_key_value_heads": 1}, use_bias=False,
                                                         tie_word_embeddings=False, **IDS),
        # Falcon-7B: one kv head, attention and MLP side by side on one LayerNorm, tied head.
        "falcon_7b_mqa": FalconConfig(**FALCON),
        # Falcon-40B/180B: 2 kv heads, query_key_value rows per kv group, ln_attn + ln_mlp, untied.
        "falcon_40b_grouped": FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2,
                                           tie_word_embeddings=False),
        # Falcon2-11B: the grouped layout with one input LayerNorm (num_ln_in_parallel_attn=1), one kv group.
        "falcon2_one_norm": FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=1,
                                         num_ln_in_parallel_attn=1),
        # falcon-rw: ALiBi instead of RoPE, multi_query=false (rows [q, k, v] per head), sequential
        # block, biases everywhere.
        "falcon_rw_alibi": FalconConfig(**FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True),
        # Phi-4-mini: Phi-3 with 0.75 of each head rotated (halves of the rotated part paired).
        "phi4_mini_partial": Phi3Config(**TINY, sliding_window=None, partial_rotary_factor=0.75, **IDS),
        # ... with longrope over the rotated dims (6 factors); within the pretraining length here.
        "phi4_mini_partial_longrope": Phi3Config(
            **TINY, sliding_window=None, original_max_position_embeddings=256, tie_word_embeddings=True, **IDS,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + 0.3 * i for i in range(_ROT)],
                             "long_factor": [2.0 + i for i in range(_ROT)]}),
    }


def to_chatglm(hf: torch.nn.Module, path: Path) -> None:
    """Write ``hf`` (a transformers ``GlmForCausalLM``) as THUDM's ChatGLM2/3/GLM-4 checkpoint.

    The equivalence: transformers' GLM is THUDM's model renamed (its converter splits
    ``query_key_value`` into q/k/v and renames the rest, nothing else), so joining q/k/v back
    into ``[q | k | v]`` rows and putting back THUDM's names and config keys gives a ChatGLM
    checkpoint whose logits are the Glm model's: same interleaved rotary on half of each head
    (``kv_channels / 2`` dims, base ``10000 * rope_ratio``), same SwiGLU over ``[gate | up]``
    (``dense_h_to_4h``), same RMSNorms, q/k/v bias only (``add_qkv_bias``)."""
    cfg = hf.config
    renames = {
        "model.embed_tokens.": "transformer.embedding.word_embeddings.",
        "model.norm.": "transformer.encoder.final_layernorm.",
        "model.layers.": "transformer.encoder.layers.", "lm_head.": "transformer.output_layer.",
        ".self_attn.o_proj.": ".self_attention.dense.", ".mlp.gate_up_proj.": ".mlp.dense_h_to_4h.",
        ".mlp.down_proj.": ".mlp.dense_4h_to_h.",
    }
    state = hf.state_dict()
    out: dict[str, torch.Tensor] = {"transformer.rotary_pos_emb.inv_freq": torch.ones(cfg.head_dim // 4)}
    for name, tensor in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            qkv = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            tensor, name = torch.cat(qkv), name.replace(".self_attn.q_proj.", ".self_attention.query_key_value.")
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name] = tensor.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["ChatGLMModel"], "model_type": "chatglm",
        "auto_map": {"AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
        "num_layers": cfg.num_hidden_layers, "padded_vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size, "kv_channels": cfg.head_dim,
        "num_attention_heads": cfg.num_attention_heads, "multi_query_attention": True,
        "multi_query_group_num": cfg.num_key_value_heads, "seq_length": cfg.max_position_embeddings,
        "layernorm_epsilon": cfg.rms_norm_eps, "rmsnorm": True, "apply_residual_connection_post_layernorm": False,
        "post_layer_norm": True, "add_bias_linear": False, "add_qkv_bias": True, "bias_dropout_fusion": True,
        "original_rope": True, "rope_ratio": cfg.rope_parameters["rope_theta"] / 10000.0,
        "apply_query_key_layer_scaling": True, "attention_softmax_in_fp32": True, "fp32_residual_connection": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "pre_seq_len": None, "prefix_projection": False,
        "torch_dtype": "bfloat16", "eos_token_id": IDS["eos_token_id"], "pad_token_id": IDS["pad_token_id"],
        "tie_word_embeddings": False,
    }))


# Cases whose checkpoint the engine reads is a conversion of the transformers one.
CONVERT = {"chatglm": to_chatglm}


@pytest.fixture(scope="module", params=sorted(_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(HF reference model loaded back from disk, ours loaded from the same files, the directory)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    save_tiny(_configs()[name], path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if name in CONVERT:
        CONVERT[name](hf, path / "converted")
        path = path / "converted"
    return hf, load_ours(path), path


def test_prefill_matches_hf(tiny) -> None:
    """Single-sequence prefills of several lengths."""
    hf, ours, _ = tiny
    check_prefills(hf, ours)


def test_two_sequence_batch_matches_hf(tiny) -> None:
    """Two sequences flattened into one prefill batch."""
    hf, ours, _ = tiny
    check_two_sequence_batch(hf, ours)


def test_prefill_then_decode_matches_hf(tiny) -> None:
    """Prefill, then a batched and a single decode step reading the cached keys."""
    hf, ours, _ = tiny
    check_prefill_then_decode(hf, ours)


def test_chunked_prefill_matches_hf(tiny) -> None:
    """A prefill split in two chunks (the second attends to the cached first)."""
    hf, ours, _ = tiny
    check_chunked_prefill(hf, ours)


def test_greedy_tokens_match_hf_generate(tiny) -> None:
    """Greedy decoding through the engine (scheduler, runner, sampler) equals ``generate``."""
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"])


def test_chatglm_reads_thudm_names(tiny) -> None:
    """The converted checkpoint is read as ChatGLM: its config's names give Glm's shape."""
    hf, ours, _ = tiny
    if ours.config.architecture != "ChatGLMModel":
        pytest.skip("ChatGLM only")
    cfg = ours.config
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (2, 2, 16, 50000.0)
    rotary = ours.model.layers[0].self_attn.rotary_emb
    assert (rotary.rotary_dim, rotary.interleaved) == (8, True)


def test_chatglm_v1_is_refused_when_its_config_is_read() -> None:
    """ChatGLM-6B (v1: 2D positions, another layout) shares the architecture name: refused by name."""
    cfg = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers": 2, "hidden_size": 64,
           "num_attention_heads": 4, "inner_hidden_size": 256, "position_encoding_2d": True, "vocab_size": 128}
    with pytest.raises(UnsupportedModelError, match="ChatGLM-6B"):
        ModelConfig.from_dict(cfg)


# Each case's RoPE: (rotated dims of the 16-dim heads, interleaved pairs, rotated in the store kernel).
ROTARY = {"glm": (8, True, False), "glm4_mqa_tied": (8, True, False), "chatglm": (8, True, False),
          "phi4_mini_partial": (12, False, False), "phi4_mini_partial_longrope": (12, False, False),
          "falcon_rw_alibi": (0, False, False)}


def test_rotary_layout_comes_from_the_family_and_config(tiny, request) -> None:
    """GLM/ChatGLM rotate half of each head in neighbour pairs, Phi-4-mini 0.75 in halves (both in
    torch), falcon-rw nothing (ALiBi slopes on its attention instead); the others rotate whole
    heads in the fused store kernel."""
    _, ours, _ = tiny
    name = request.node.callspec.params["tiny"]
    rotary = ours.model.layers[0].self_attn.rotary_emb
    assert (rotary.rotary_dim, rotary.interleaved, rotary.fused) == ROTARY.get(name, (16, False, True))
    slopes = ours.attention_layers()[0].alibi_slopes
    assert (slopes is not None) == (name == "falcon_rw_alibi")


def test_phi4_mini_older_config_spelling(tiny, tmp_path: Path) -> None:
    """Phi-4-mini's published config.json: top-level partial_rotary_factor and rope_theta, and
    rope_scaling={"type": "longrope", ...} without the factor: the same model."""
    hf, _, path = tiny
    if not path.name.startswith("phi4_mini_partial_longrope"):
        pytest.skip("Phi-4-mini longrope only")
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg.update(partial_rotary_factor=params["partial_rotary_factor"], rope_theta=params["rope_theta"],
               rope_scaling={"type": "longrope", "short_factor": params["short_factor"],
                             "long_factor": params["long_factor"]})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tokens = random_tokens(12, seed=80)
    assert_close(PagedCache(load_ours(tmp_path)).step({0: tokens})[0], hf_logits(hf, tokens))


# Tensor parallel (CPU, gloo): the grouped-kv GLM (q/k/v bias, rotary in torch on each rank's
# heads), Falcon-40B's per-group query_key_value (unpacked, then split by rank), Falcon-7B's
# single kv head (replicated on both ranks, as QKVLinear does whenever tp exceeds the kv heads)
# and falcon-rw (each rank its heads' ALiBi slopes; biases added once).
TP_CASES = ("glm", "falcon_7b_mqa", "falcon_40b_grouped", "falcon_rw_alibi")


@pytest.mark.parametrize("tp", [2])
def test_tp_matches_tp1(tiny, tp, request) -> None:
    """tp=2 gives tp=1's greedy tokens and logprobs."""
    from test_tensor_parallel import _run, _same

    _, _, path = tiny
    if request.node.callspec.params["tiny"] not in TP_CASES:
        pytest.skip("GLM and the Falcon layouts only")
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, tp)
    _same(trace1, trace_tp)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-4)


def _copy_with_config(src: Path, dst: Path, edit) -> Path:
    """``src``'s files in ``dst`` with config.json passed through ``edit``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(cfg)))
    return dst


def _refined_web(cfg: dict) -> dict:
    """The config.json Falcon had before transformers: RWForCausalLM, n_head/n_layer(/n_head_kv),
    model_type RefinedWebModel (7B) or RefinedWeb (40B, always the grouped layout)."""
    grouped = cfg.pop("new_decoder_architecture")
    kv_heads = cfg.pop("num_kv_heads")
    out = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "num_ln_in_parallel_attn")}
    if out.get("tie_word_embeddings"):
        del out["tie_word_embeddings"]  # tied: the default, left out as the old configs did
    out.update(architectures=["RWForCausalLM"], model_type="RefinedWeb" if grouped else "RefinedWebModel",
               n_head=out.pop("num_attention_heads"), n_layer=out.pop("num_hidden_layers"))
    if grouped:
        out["n_head_kv"] = kv_heads
    return out


def test_falcon_refined_web_configs_load(tiny, tmp_path: Path, request) -> None:
    """Falcon-7B and -40B as first published (RWForCausalLM, RefinedWeb names) give the same logits."""
    hf, ours, path = tiny
    if request.node.callspec.params["tiny"] not in ("falcon_7b_mqa", "falcon_40b_grouped"):
        pytest.skip("Falcon-7B and -40B layouts only")
    old = load_ours(_copy_with_config(path, tmp_path / "rw", _refined_web))
    assert old.config.architecture == "RWForCausalLM"
    tokens = random_tokens(12, seed=81)
    assert_close(PagedCache(old).step({0: tokens})[0], hf_logits(hf, tokens))


def test_missing_weight_is_named(tiny, tmp_path: Path) -> None:
    """A Falcon-40B checkpoint without one layer's ln_mlp bias: the error names that parameter."""
    _, ours, path = tiny
    if ours.config.architecture != "FalconForCausalLM" or not ours.config.raw.get("new_decoder_architecture") \
            or ours.config.raw.get("num_ln_in_parallel_attn") == 1:
        pytest.skip("Falcon-40B layout only")
    dst = _copy_with_config(path, tmp_path / "missing", lambda cfg: cfg)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["transformer.h.1.ln_mlp.bias"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"missing parameters \(1\): model\.layers\.1\.ln_mlp\.bias"):
        load_ours(dst)


def test_triton_kernels_match_hf(tiny) -> None:
    """The whole model through the Triton kernels (fused rotary + KV store where the family's RoPE
    allows, pre-rotated keys stored otherwise; windows go to the reference): on CPU under
    Triton's interpreter, on a GPU compiled."""
    hf, ours, _ = tiny
    check_triton_kernels(hf, ours)


@pytest.mark.parametrize("name", ["starcoder2_window8", "falcon_7b_mqa"])
def test_w8a8_layer_norm_families_are_refused_before_loading(name: str) -> None:
    """W8A8 linears read int8 rows from the norm before them; LayerNorm makes none: refused when built."""
    cfg = _configs()[name].to_dict()
    cfg["architectures"] = [{"starcoder2": "Starcoder2ForCausalLM"}.get(cfg["model_type"], "FalconForCausalLM")]
    config = ModelConfig.from_dict(cfg)
    config.quant = SimpleNamespace(takes_int8_input=True)
    with pytest.raises(UnsupportedModelError, match="W8A8"):
        build_model(config, dtype=torch.float32)


def test_quantized_falcon_with_grouped_qkv_is_refused_before_loading() -> None:
    """Unpacking per-group query_key_value rows of packed (AWQ) tensors is not written: refused when built."""
    cfg = _configs()["falcon_40b_grouped"].to_dict()
    cfg["architectures"] = ["FalconForCausalLM"]
    config = ModelConfig.from_dict(cfg)
    config.quant = SimpleNamespace(takes_int8_input=False)
    with pytest.raises(UnsupportedModelError, match="grouped query_key_value"):
        build_model(config, dtype=torch.float32)


def test_glm_with_an_int8_kv_cache(tiny) -> None:
    """Keys rotated in torch (partial, interleaved) go into a quantized cache uncentred: greedy
    through an int8-cache engine equals the 16-bit cache's on the tiny GLM."""
    from tiny_llama import engine, greedy

    _, ours, path = tiny
    if ours.config.architecture != "GlmForCausalLM":
        pytest.skip("GLM only")
    prompt = random_tokens(7, seed=90)
    runs = []
    for policy in (0, 8):
        eng = engine(path, quant_policy=policy)
        try:
            runs.append(greedy(eng, prompt, n=8))
        finally:
            eng.close()
    assert runs[0] == runs[1]


def test_falcon_7b_heads_at_tp2_are_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """Falcon-7B's 71 query heads do not split over 2 ranks (its one kv head would replicate):
    an EngineConfigError naming the heads, before any rank starts or any weight is read."""
    from tiny_llama import engine

    save_tiny(FalconConfig(**{**FALCON, "hidden_size": 142, "num_attention_heads": 71}), tmp_path)
    with pytest.raises(EngineConfigError, match="71"):
        engine(tmp_path, tp=2)
