"""DeepSeek-MoE (v1, ``DeepseekForCausalLM``) and the DeepSeek MoE block DeepSeek-V2 reuses,
against transformers.

transformers has no class for DeepSeek-MoE v1 (it ships remote code) and nothing here can be
downloaded, so the reference is the transformers model that computes the same function: a tiny
random ``LlamaForCausalLM`` (v1's attention, norms, RoPE and dense MLP are Llama's) whose sparse
layers' ``mlp`` is transformers' own ``DeepseekV2Moe`` built with ``topk_method="greedy"`` and
``routed_scaling_factor=1.0``. That module is the published v1 ``DeepseekMoE`` block: the router
``F.linear(x, gate.weight)`` scored by softmax over all experts, ``torch.topk`` of the scores
(weights not renormalised: v1's ``norm_topk_prob`` is false), each chosen expert a gated SiLU MLP
``down(silu(gate(x)) * up(x))`` times its weight, plus ``shared_experts``, one gated MLP of
``moe_intermediate_size * n_shared_experts`` added with no gate; it computes the router in fp32
where v1 computes it in the model's dtype, the same in the float32 tests. transformers'
``DeepseekV2Moe`` never renormalises (it drops ``norm_topk_prob``), so where a config sets it the
reference's router divides its top-k weights by their sum (``RenormalizedRouter``: v1's
``MoEGate`` with ``norm_topk_prob``). The weights are written in the v1 checkpoint's names
(``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.*``)
with a v1 config.json, loaded by the engine and compared (CPU, float32, logits within 1e-4,
test_models.py's checks). The block alone is also checked against ``DeepseekV2Moe`` with V2's
``group_limited_greedy`` and a ``routed_scaling_factor`` other than 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import (
    TINY,
    _randomize,
    check_chunked_prefill,
    check_engine_batch_and_ppl,
    check_greedy_matches_generate,
    check_prefill_then_decode,
    check_prefills,
    check_triton_kernels,
    check_two_sequence_batch,
    load_ours,
)
from test_models_remote_code_families import _write
from tiny_llama import engine
from transformers import DeepseekV2Config, LlamaConfig, LlamaForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe, DeepseekV2TopkRouter

from conveyor.engine.layers.moe import SparseMoeBlock
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.models.deepseek import build_deepseek_mlp
from conveyor.engine.models.llama import LlamaMLP, LlamaVariant
from conveyor.kernels.moe import select_experts
from conveyor.protocol.errors import EngineConfigError, UnsupportedModelError
from conveyor.services.tokenizer.chat_template import ChatTemplateConfig, get_chat_template

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
MHA = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]}  # DeepSeek-MoE 16B is MHA

# Tiny v1 configs (config.json fields): the released layout (layer 0 dense, the rest sparse,
# 2 shared experts, no renormalisation) and one with moe_layer_freq=2 and norm_topk_prob.
CONFIGS = {
    "v1": dict(num_hidden_layers=2, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=8,
               num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=False),
    "freq2_renorm": dict(num_hidden_layers=3, first_k_dense_replace=0, moe_layer_freq=2, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True),
}
SPARSE = {"v1": [False, True], "freq2_renorm": [True, False, True]}
MOE_WIDTH = 32


class RenormalizedRouter(DeepseekV2TopkRouter):
    """v1's ``MoEGate`` with ``norm_topk_prob``: the top-k weights divided by their sum (+1e-20)."""

    def forward(self, hidden_states):
        logits, weights, ids = super().forward(hidden_states)
        return logits, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids


def v2_moe_config(hidden: int, **kw) -> DeepseekV2Config:
    """A DeepseekV2Config carrying only what ``DeepseekV2Moe`` reads (attention sizes unused)."""
    return DeepseekV2Config(hidden_size=hidden, num_attention_heads=4, moe_intermediate_size=MOE_WIDTH,
                            hidden_act="silu", mlp_bias=False, **kw)


def deepseek_v1(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """The reference model of ``CONFIGS[name]``, written to ``path`` as a v1 checkpoint."""
    c = CONFIGS[name]
    llama = LlamaConfig(**{**MHA, "num_hidden_layers": c["num_hidden_layers"]}, rms_norm_eps=1e-6, **IDS)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(llama).float().eval()
    moe = v2_moe_config(llama.hidden_size, n_routed_experts=c["n_routed_experts"],
                        num_experts_per_tok=c["num_experts_per_tok"], n_shared_experts=c["n_shared_experts"],
                        topk_method="greedy", routed_scaling_factor=1.0)
    for i, sparse in enumerate(SPARSE[name]):
        if sparse:
            block = DeepseekV2Moe(moe)
            if c["norm_topk_prob"]:
                block.gate = RenormalizedRouter(moe)
            hf.model.layers[i].mlp = block
    _randomize(hf, seed)
    config = {**{k: v for k, v in llama.to_dict().items() if k in MHA or k in IDS},
              "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False,
              "moe_intermediate_size": MOE_WIDTH, "scoring_func": "softmax", "aux_loss_alpha": 0.001,
              "seq_aux": True, "torch_dtype": "float32", **c}
    _write(path, config, v1_tensors(hf.state_dict()))
    return hf


def v1_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) as v1's per-expert tensors; every other name is already v1's."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, rows in enumerate(t):
                gate, up = rows.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, w in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(the reference model, ours loaded from its v1 checkpoint, the directory)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = deepseek_v1(request.param, path)
    return hf, load_ours(path), path


def test_logits_match_reference(tiny) -> None:
    """Prefills of several lengths, a two-sequence batch, prefill then decode, a chunked prefill."""
    hf, ours, _ = tiny
    check_prefills(hf, ours, (5, 13, 30))
    check_two_sequence_batch(hf, ours)
    check_prefill_then_decode(hf, ours)
    check_chunked_prefill(hf, ours)


def test_layers_are_sparse_or_dense_as_configured(tiny) -> None:
    """first_k_dense_replace and moe_layer_freq pick the dense layers; the shared experts are one
    ungated MLP of moe_intermediate_size * n_shared_experts."""
    _, ours, path = tiny
    raw = json.loads((path / "config.json").read_text())
    name = "v1" if raw["moe_layer_freq"] == 1 else "freq2_renorm"
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == SPARSE[name]
    for layer in ours.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            assert layer.mlp.shared_expert_gate is None
            assert layer.mlp.shared_expert.down_proj.weight.shape[1] == MOE_WIDTH * raw["n_shared_experts"]
            assert layer.mlp.experts.renormalize == raw["norm_topk_prob"]


def test_greedy_engine_batch_and_ppl_match_reference(tiny) -> None:
    """Greedy decoding equals ``generate``; the engine's batch, prefix cache and get_ppl agree."""
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"], (50,))
    check_engine_batch_and_ppl(hf, path, IDS["eos_token_id"])


def test_triton_kernels_match_reference(tiny) -> None:
    """The whole model in Triton mode."""
    hf, ours, _ = tiny
    check_triton_kernels(hf, ours)


def test_tp2_matches_tp1(tiny) -> None:
    """Every rank holds each routed expert's, the shared experts' and the dense layer's slice of
    the intermediate dim: tp=2 gives tp=1's greedy tokens and logprobs (CPU, gloo)."""
    from test_tensor_parallel import _run, _same

    _, _, path = tiny
    if json.loads((path / "config.json").read_text())["moe_layer_freq"] != 1:
        pytest.skip("one layout: v1's has a dense layer, routed and shared experts")
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, 2)
    _same(trace1, trace_tp)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-4)


def test_quantized_checkpoint_is_refused_before_loading(tmp_path: Path) -> None:
    """An AWQ config.json is an EngineConfigError naming the dense checkpoint; the directory holds
    no weights at all, so nothing was read before the refusal."""
    cfg = {**MHA, **IDS, **CONFIGS["v1"], "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
           "moe_intermediate_size": MOE_WIDTH,
           "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                   "version": "gemm"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineConfigError, match="fp16/bf16 checkpoint"):
        engine(tmp_path)


# ---- the block alone, with DeepSeek-V2's routing options -------------------------------------


def _config(**raw) -> ModelConfig:
    base = {**MHA, "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "hidden_act": "silu",
            "moe_intermediate_size": MOE_WIDTH, "n_routed_experts": 8, "num_experts_per_tok": 3,
            "n_shared_experts": 2, "first_k_dense_replace": 0, "moe_layer_freq": 1}
    return ModelConfig.from_dict({**base, **raw})


def _ours_from(ref: DeepseekV2Moe, config: ModelConfig) -> torch.nn.Module:
    """``build_deepseek_mlp``'s layer-0 block with ``ref``'s weights, through the model's loader names."""
    block = build_deepseek_mlp(config, 0, LlamaVariant())
    params = dict(block.named_parameters())
    e = config.raw["n_routed_experts"]
    with torch.no_grad():
        params["gate.weight"].copy_(ref.gate.weight)
        for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
            params["shared_expert.gate_up_proj.weight"].weight_loader(
                params["shared_expert.gate_up_proj.weight"], getattr(ref.shared_experts, proj).weight, shard)
        params["shared_expert.down_proj.weight"].copy_(ref.shared_experts.down_proj.weight)
    block.experts.weight_loader(block.experts.w13, ref.experts.gate_up_proj.detach(), None)
    block.experts.weight_loader(block.experts.w2, ref.experts.down_proj.detach(), None)
    assert block.experts.w13.shape[0] == e
    return block


@pytest.mark.parametrize(("topk_method", "groups", "scale"), [
    ("group_limited_greedy", (4, 2), 16.0),  # DeepSeek-V2's: 4 groups of 2 experts, the best 2 groups
    ("group_limited_greedy", (2, 1), 0.5),
    ("greedy", (None, None), 2.5),  # V2-Lite's
])
def test_block_matches_deepseek_v2_moe(topk_method: str, groups: tuple, scale: float) -> None:
    """``build_deepseek_mlp``'s block equals transformers' ``DeepseekV2Moe`` (grouped top-k: a
    group scores its best expert; the routed output times routed_scaling_factor; shared experts
    added ungated) on 40 tokens, float32, within 1e-5, and picks the same experts."""
    n_group, topk_group = groups
    raw = dict(topk_method=topk_method, routed_scaling_factor=scale, n_group=n_group, topk_group=topk_group)
    torch.manual_seed(3)
    ref = DeepseekV2Moe(v2_moe_config(MHA["hidden_size"], n_routed_experts=8, num_experts_per_tok=3,
                                      n_shared_experts=2, **raw)).float().eval()
    _randomize(ref, 3)
    ours = _ours_from(ref, _config(**raw))
    x = torch.randn(40, MHA["hidden_size"], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, _, ref_ids = ref.gate(x)
        _, ids = select_experts(ours.gate(x), 3, False, "softmax", n_group, topk_group)
        assert torch.equal(ids.long().sort(dim=-1).values, ref_ids.sort(dim=-1).values)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_grouped_top_k_is_not_plain_top_k() -> None:
    """The grouped case above can fail: on these tokens group-limited choice differs from greedy."""
    torch.manual_seed(3)
    ref = DeepseekV2Moe(v2_moe_config(MHA["hidden_size"], n_routed_experts=8, num_experts_per_tok=3,
                                      n_shared_experts=2, topk_method="greedy")).float().eval()
    _randomize(ref, 3)
    grouped = _ours_from(ref, _config(topk_method="group_limited_greedy", n_group=4, topk_group=2))
    x = torch.randn(40, MHA["hidden_size"], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (grouped(x) - ref(x)).abs().max() > 1e-3


@pytest.mark.parametrize(("raw", "match"), [
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (dict(topk_method="noaux_tc", scoring_func="softmax"), "noaux_tc"),
    (dict(norm_topk_prob=True, routed_scaling_factor=2.0), "norm_topk_prob=true with routed_scaling_factor"),
    (dict(topk_method="group_limited_greedy"), "needs n_group and topk_group"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "n_group dividing"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1), "fewer than the 3 experts"),
])
def test_unsupported_routing_is_refused(raw: dict, match: str) -> None:
    """V3's router and the combinations select_experts cannot run name themselves."""
    with pytest.raises(UnsupportedModelError, match=match):
        build_deepseek_mlp(_config(**raw), 0, LlamaVariant())


def test_dense_everywhere_without_routed_experts() -> None:
    """n_routed_experts absent: every layer is the dense MLP (the published rule)."""
    assert isinstance(build_deepseek_mlp(_config(n_routed_experts=None), 0, LlamaVariant()), LlamaMLP)


def test_dummy_shape_parameter_count() -> None:
    """deepseek-moe-16b builds on the meta device with the published 16.4B parameters, ~2.8B of
    them read per token (6 of 64 routed experts, the 2 shared ones, the dense first layer)."""
    from conveyor.engine.dummy_model import shape_config
    from conveyor.engine.models import build_model

    config = ModelConfig.from_dict(shape_config("deepseek-moe-16b"))
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(layer.mlp.experts.w13.numel() + layer.mlp.experts.w2.numel() for layer in model.model.layers
                 if isinstance(layer.mlp, SparseMoeBlock))
    # Active: all but the unread routed experts; the input embedding is a lookup, counted as read.
    active = total - routed * (64 - 6) // 64
    assert total / 1e9 == pytest.approx(16.4, abs=0.05)
    assert active / 1e9 == pytest.approx(2.8, abs=0.1)


# ---- the chat template ---------------------------------------------------------------------------

# deepseek-ai/deepseek-llm-7b-chat's and deepseek-moe-16b-chat's tokenizer_config.json "chat_template".
DEEPSEEK_JINJA = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}")
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"


@pytest.mark.parametrize("with_system", [True, False])
def test_chat_template_equals_published_jinja(with_system: bool) -> None:
    """The built-in ``deepseek`` template gives the published template's string (BOS aside: the
    tokenizer adds it) for a system message, two user turns with an answer between, and the
    generation prompt ``Assistant:``; a later turn of a session continues it."""
    from test_chat_templates_families import SYSTEM, TURNS, _builtin, _render_jinja

    messages = (SYSTEM if with_system else []) + TURNS
    assert _builtin("deepseek", messages) == _render_jinja(DEEPSEEK_JINJA, messages, eos_token=EOS)
    template = ChatTemplateConfig("deepseek").to_template()
    assert template.stop_words == [EOS]
    assert template.get_prompt("Name a prime.", sequence_start=False) == "User: Name a prime.\n\nAssistant:"


@pytest.mark.parametrize(("path", "name"), [
    ("/models/deepseek-ai/deepseek-moe-16b-chat", "deepseek"),
    ("deepseek-llm-7b-chat", "deepseek"),
    ("/m/DeepSeek-V2-Lite-Chat", "deepseek"),
    ("/m/deepseek-moe-16b-base", "base"),  # base models take plain text (LMDeploy's rule)
    ("/m/deepseek-vl-7b-chat", "deepseek-vl"),  # its own template (issue 33)
])
def test_chat_template_matched_from_path(path: str, name: str) -> None:
    """A DeepSeek chat model's path picks ``deepseek`` when its tokenizer ships no template."""
    assert get_chat_template(path).name == name
