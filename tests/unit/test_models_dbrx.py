# ruff: noqa: E501  (the published chat template below is quoted verbatim, long lines included)
"""DBRX against transformers: tiny random models (2 layers, d_model 64, 4 heads over 2 kv heads,
top-2 of 4 or 8 experts 32 wide) saved with ``save_pretrained``, loaded by the engine; float32
logits within 1e-4, greedy tokens, the engine's batch and ``get_ppl``, the Triton kernels, tp=2.

Both configs clip q/k/v at 1.0, which clamps about a fifth of these random q/k/v outputs (the
test asserts that it clips, and that logits without the clamp are off by far more than the
tolerance). One renormalises the top-k weights (``moe_normalize_expert_weights=1``, every
release), the other keeps the softmax weights (None). RoPE's base is not the default, in both
the places transformers 5 writes it.

Also: the config's nested fields as released (no ``rope_parameters``), refusals (another p-norm,
quantized checkpoints), the dummy shape's parameter counts and the ``dbrx`` chat template against
dbrx-instruct's published Jinja template rendered by a transformers tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from test_models import (
    PagedCache,
    assert_close,
    check_chunked_prefill,
    check_engine_batch_and_ppl,
    check_greedy_matches_generate,
    check_prefill_then_decode,
    check_prefills,
    check_triton_kernels,
    check_two_sequence_batch,
    hf_logits,
    load_ours,
    random_tokens,
)
from tiny_llama import engine
from transformers import AutoModelForCausalLM, DbrxConfig

from conveyor.engine.model_config import ModelConfig
from conveyor.protocol.errors import EngineConfigError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CLIP = 1.0
ROPE_THETA = 50000.0


def _config(experts: int, p: float | None) -> DbrxConfig:
    return DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128,
                      attn_config=dict(kv_n_heads=2, clip_qkv=CLIP, rope_theta=ROPE_THETA),
                      rope_parameters=dict(rope_type="default", rope_theta=ROPE_THETA),
                      ffn_config=dict(ffn_hidden_size=32, moe_num_experts=experts, moe_top_k=2,
                                      moe_normalize_expert_weights=p), **IDS)


CONFIGS = {"dbrx_renormalised": _config(8, 1.0), "dbrx_softmax_weights": _config(4, None)}


def save_dbrx(config: DbrxConfig, path: Path, seed: int = 0) -> None:
    """test_models.save_tiny's draw (norm weights near 1, the rest 0.1 * N(0, 1)), the norms told
    apart by their own names: save_tiny's test for "norm" anywhere in the name would also catch
    DBRX's Wqkv and out_proj, which live under ``norm_attn_norm``."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if name.split(".")[-2].startswith("norm") else 0.1 * noise)
    hf.save_pretrained(path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(HF reference model loaded back from disk, ours loaded from the same files, the directory)."""
    path = tmp_path_factory.mktemp(request.param)
    save_dbrx(CONFIGS[request.param], path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_ours(path), path


def test_logits_match_hf(tiny) -> None:
    """Prefills of several lengths, a two-sequence batch, prefill then decode, a chunked prefill."""
    hf, ours, _ = tiny
    check_prefills(hf, ours, (5, 13, 30))
    check_two_sequence_batch(hf, ours)
    check_prefill_then_decode(hf, ours)
    check_chunked_prefill(hf, ours)


def test_config_reaches_the_layers(tiny) -> None:
    """The nested config's experts, top-k, p-norm, clip and RoPE base are the layers' own."""
    _, ours, path = tiny
    ffn = json.loads((path / "config.json").read_text())["ffn_config"]
    for layer in ours.model.layers:
        experts = layer.mlp.experts
        assert (experts.num_experts, experts.top_k, experts.inter_size) == (ffn["moe_num_experts"], 2, 32)
        assert experts.renormalize == (ffn["moe_normalize_expert_weights"] is not None)
        assert layer.self_attn.qkv_proj.clip == CLIP
        assert layer.input_layernorm.bias is None and layer.post_attention_layernorm.bias is None
    assert ours.config.rope_theta == ROPE_THETA and ours.config.rms_norm_eps == 1e-5


def test_transformers_saves_the_released_expert_layout(tiny) -> None:
    """transformers 5 writes the experts as the released checkpoints hold them (fused w1 / v1 / w2,
    each [E * I, H]): the one layout the loader reads."""
    from safetensors import safe_open

    _, ours, path = tiny
    e, i, h = ours.config.num_experts, ours.config.intermediate_size, ours.config.hidden_size
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if ".ffn.experts." in n]
        assert sorted(names) == sorted(f"transformer.blocks.{b}.ffn.experts.mlp.{p}" for b in range(2)
                                       for p in ("w1", "v1", "w2"))
        assert all(tuple(f.get_slice(n).get_shape()) == (e * i, h) for n in names)


def test_clip_qkv_clamps_and_matters(tiny) -> None:
    """The clamp acts on these weights (some q/k/v outputs lie past ±clip_qkv), and the model
    without it is off by far more than the tolerance: the parity tests above would fail without
    the clamp. With ``clip_qkv`` null the engine equals transformers' model that never clips
    (transformers 5.24 itself cannot run a null clip_qkv: its clamp gets two Nones)."""
    hf, ours, _ = tiny
    tokens = random_tokens(13, seed=60)
    seen: list[torch.Tensor] = []
    handle = ours.model.layers[0].self_attn.qkv_proj.linear.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        clipped = PagedCache(ours).step({0: tokens})[0]
    finally:
        handle.remove()
    assert (seen[0].abs() > CLIP).float().mean() > 0.05
    try:
        for layer in ours.model.layers:
            layer.self_attn.qkv_proj.clip = None
        unclipped = PagedCache(ours).step({0: tokens})[0]
    finally:
        for layer in ours.model.layers:
            layer.self_attn.qkv_proj.clip = CLIP
    assert (unclipped - clipped).abs().max() > 1e-2
    try:
        for block in hf.transformer.blocks:
            block.norm_attn_norm.attn.clip_qkv = 1e9
        assert_close(unclipped, hf_logits(hf, tokens))
    finally:
        for block in hf.transformer.blocks:
            block.norm_attn_norm.attn.clip_qkv = CLIP


def test_null_clip_qkv_builds_no_clamp(tiny, tmp_path: Path) -> None:
    """A config without ``clip_qkv`` (null) loads the same weights with no clamp."""
    _, _, path = tiny
    cfg = json.loads((path / "config.json").read_text())
    cfg["attn_config"]["clip_qkv"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    assert all(layer.self_attn.qkv_proj.clip is None for layer in load_ours(tmp_path).model.layers)


def test_greedy_engine_batch_and_ppl_match_hf(tiny) -> None:
    """Greedy decoding equals ``generate``; the engine's batch, prefix cache and get_ppl agree."""
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"], (50, 51))
    check_engine_batch_and_ppl(hf, path, IDS["eos_token_id"])


def test_triton_kernels_match_hf(tiny) -> None:
    """The whole model in Triton mode: attention, RoPE and the fused-MoE kernel."""
    hf, ours, _ = tiny
    check_triton_kernels(hf, ours)


def test_tp2_matches_tp1(tiny) -> None:
    """Each rank its q/k/v heads (clamped there) and every expert's slice of the intermediate dim,
    read lazily from the fused [E * I, H] tensors: tp=2 gives tp=1's greedy tokens and logprobs."""
    from test_tensor_parallel import _run, _same

    _, _, path = tiny
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, 2)
    _same(trace1, trace_tp)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-4)


# The published dbrx-instruct config.json's fields (transformers 4.38 wrote it: no rope_parameters).
RELEASED = {"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 6144, "n_heads": 48,
            "n_layers": 40, "max_seq_len": 32768, "vocab_size": 100352,
            "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "model_type": "", "rope_theta": 500000},
            "ffn_config": {"ffn_hidden_size": 10752, "model_type": "", "moe_jitter_eps": 0, "moe_loss_weight": 0.05,
                           "moe_num_experts": 16, "moe_top_k": 4},
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_released_config_fields() -> None:
    """The nested fields as released map to ModelConfig; RoPE's base is attn_config's 500000 (which
    transformers 5.24 drops, reading such a config with its default 10000)."""
    cfg = ModelConfig.from_dict(RELEASED)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (6144, 48, 8, 128, 40)
    assert (cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (10752, 16, 4)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) == (500000.0, None, 32768)
    assert cfg.dtype == torch.bfloat16 and not cfg.tie_word_embeddings


def test_rope_base_from_attn_config_over_a_rewritten_rope_parameters(caplog) -> None:
    """A released config re-saved by transformers 5 carries rope_parameters.rope_theta=10000 next to
    attn_config's 500000: attn_config's is used, and the difference is logged."""
    from conveyor.engine.models import build_model

    raw = {**RELEASED, "n_layers": 1, "d_model": 64, "n_heads": 4, "vocab_size": 128,
           "attn_config": {**RELEASED["attn_config"], "kv_n_heads": 2},
           "ffn_config": {**RELEASED["ffn_config"], "ffn_hidden_size": 32, "moe_num_experts": 4},
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    with caplog.at_level(logging.WARNING, logger="conveyor.engine.models.dbrx"):
        build_model(cfg, dtype=torch.float32, device="meta")
    assert "rope_parameters.rope_theta=10000.0 differs from attn_config.rope_theta=500000.0" in caplog.text


@pytest.mark.parametrize(("ffn", "message"), [
    ({"moe_normalize_expert_weights": 2}, "moe_normalize_expert_weights=2"),
    ({"moe_normalize_expert_weights": 0.5}, "moe_normalize_expert_weights=0.5"),
    ({"uniform_expert_assignment": True}, "uniform_expert_assignment=true"),
    ({"ffn_act_fn": {"name": "gelu", "approximate": "tanh"}}, "not \\['approximate'\\]"),
])
def test_unimplemented_ffn_options_are_refused(ffn: dict, message: str) -> None:
    """Another p-norm than 1 / None, llm-foundry's uniform assignment and activation arguments are
    each an UnsupportedModelError naming the field, raised before any weight is allocated."""
    from conveyor.engine.models import build_model

    raw = {**RELEASED, "ffn_config": {**RELEASED["ffn_config"], **ffn}}
    with pytest.raises(UnsupportedModelError, match=message):
        build_model(ModelConfig.from_dict(raw), dtype=torch.bfloat16, device="meta")


def test_quantized_checkpoint_is_refused_before_loading(tmp_path: Path) -> None:
    """An AWQ config.json for DBRX is an EngineConfigError naming the 16-bit checkpoint; the
    directory holds no weights at all, so nothing was read before the refusal."""
    cfg = CONFIGS["dbrx_renormalised"].to_dict()
    cfg.update(architectures=["DbrxForCausalLM"], quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineConfigError, match="fp16/bf16 checkpoint"):
        engine(tmp_path)


def test_dummy_shape_parameter_count() -> None:
    """The dbrx shape builds on the meta device with DBRX's parameter counts: 131.6B in all, 36.5B
    a token reads (4 of 16 experts); Databricks rounds them to 132B and 36B."""
    from conveyor.engine.dummy_model import shape_config
    from conveyor.engine.models import build_model

    model = build_model(ModelConfig.from_dict(shape_config("dbrx")), dtype=torch.bfloat16, device="meta")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert total / 1e9 == pytest.approx(131.6, abs=0.05)
    assert (total - experts + experts * 4 // 16) / 1e9 == pytest.approx(36.5, abs=0.05)


# databricks/dbrx-instruct tokenizer_config.json "chat_template", as JSON decodes it.
DBRX_JINJA = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% elif 'system' not in messages[0]['role'] %}{% set loop_messages = messages %}{% set system_message = 'You are DBRX, created by Databricks. You were last updated in December 2023. You answer questions based on information available up to that point.\nYOU PROVIDE SHORT RESPONSES TO SHORT QUESTIONS OR STATEMENTS, but provide thorough responses to more complex and open-ended questions.\nYou assist with various tasks, from writing to coding (using markdown for code blocks \u2014 remember to use ``` with code, JSON, and tables).\n(You do not have real-time data access or code execution capabilities. You avoid stereotyping and provide balanced perspectives on controversial topics. You do not provide song lyrics, poems, or news articles and do not divulge details of your training data.)\nThis is your system prompt, guiding your responses. Do not reference it, just respond to the user. If you find yourself talking about this message, stop. You should be responding appropriately and usually that means not mentioning this.\nYOU DO NOT MENTION ANY OF THIS INFORMATION ABOUT YOURSELF UNLESS THE INFORMATION IS DIRECTLY PERTINENT TO THE USER\\'S QUERY.' %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if loop.index0 == 0 %}{% if system_message != false %}{{ '<|im_start|>system\n' + system_message | trim + '<|im_end|>\n'}}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}{% else %}{{ '\n' + '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}{% endif %}{% if (add_generation_prompt == true and loop.last) %}{{ '\n' + '<|im_start|>' + 'assistant' + '\n' }}{% endif %}{% endfor %}"

TURNS = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, how can I help?"},
         {"role": "user", "content": "Name a prime."}]
CHATS = {
    "default_system": TURNS[:1],
    "default_system_multi_turn": TURNS,
    "own_system": [{"role": "system", "content": "You are terse."}, *TURNS],
    "own_system_trimmed": [{"role": "system", "content": "\n  You are terse. \n"}, *TURNS],
    "empty_system": [{"role": "system", "content": ""}, *TURNS[:1]],
}


def _hf_tokenizer():
    """A transformers tokenizer (a one-word vocabulary: only its template is used) carrying
    dbrx-instruct's chat_template and special tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0}, unk_token="<|endoftext|>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", chat_template=DBRX_JINJA)


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_renders_as_the_hf_tokenizer(chat: str) -> None:
    """``--chat-template dbrx`` gives, string for string, what transformers' apply_chat_template
    makes of dbrx-instruct's template: the default system prompt when the chat has none, the
    first system message trimmed, ChatML turns, the generation prompt."""
    from conveyor.services.tokenizer.chat_template import template_config

    messages = CHATS[chat]
    expected = _hf_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template_config("dbrx").to_template().messages2prompt(messages) == expected


def test_chat_template_is_picked_from_the_path_unless_the_tokenizer_has_one() -> None:
    """A path naming DBRX picks ``dbrx``; a tokenizer with its own Jinja template is used as is."""
    from conveyor.services.tokenizer.chat_template import HFChatTemplate, get_chat_template

    for path in ("/models/databricks/dbrx-instruct", "/models/dbrx-base"):
        template = get_chat_template(path)
        assert template.name == "dbrx" and template.stop_words == ["<|im_end|>", "<|endoftext|>"]
    assert isinstance(get_chat_template("/models/dbrx-instruct", tokenizer=_hf_tokenizer()), HFChatTemplate)


# |get_ppl(quantized KV) - get_ppl(dense)| (nats): test_models_moe.py's bounds for the MoE
# families (test_family_capabilities.py's, int8's doubled for a routing near-tie's discrete change).
KV_TOL = {8: 1e-2, 4: 1e-1}


@pytest.mark.parametrize("policy", [8, 4])
def test_quantized_kv_cache(tiny, policy: int) -> None:
    """KV int8 / int4 (``quant_policy``) keep get_ppl within the MoE families' bounds: the clamp
    and the experts change nothing in the cache."""
    _, _, path = tiny
    texts = [random_tokens(30, seed=94), random_tokens(30, seed=95)]

    def ppl(**kw) -> list[float]:
        eng = engine(path, **kw)
        try:
            return eng.get_ppl(texts)
        finally:
            eng.close()

    dense, quantized = ppl(), ppl(quant_policy=policy)
    assert max(abs(a - b) for a, b in zip(quantized, dense)) < KV_TOL[policy]
