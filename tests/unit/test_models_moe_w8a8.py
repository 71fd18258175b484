"""W8A8 (SmoothQuant int8) checkpoints of the mixture-of-experts families (Mixtral, Qwen2-MoE with
its gated shared expert and a dense layer, Qwen3-MoE) against a plain-torch simulation of W8A8.

A tiny random model is saved with ``save_pretrained`` and quantized by ``conveyor lite
smooth_quant`` (a few calibration windows). The reference is transformers on the dequantized
weights (``q * scale``) with W8A8's activation rounding simulated in float: every quantized
linear's input quantized per token and read back, and each expert's input and its
``act(gate) * up`` likewise (``w8a8_experts``). The engine (the kernels' integer reference on the
CPU) must give its fp32 logits within 1e-4, its greedy tokens and the engine checks of
test_models.py; tp=2 gives tp=1's tokens. Independently of the tool, a checkpoint rounded to
nearest here as llm-compressor writes one (``weight_zero_point``, routers in ``ignore``) loads the
same way. DBRX and DeepSeek W8A8 checkpoints are refused.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from calibration_models import text, tokenizer
from safetensors.torch import load_file, save_file
from test_models import (
    TINY,
    check_chunked_prefill,
    check_engine_batch_and_ppl,
    check_greedy_matches_generate,
    check_prefill_then_decode,
    check_prefills,
    check_two_sequence_batch,
    save_tiny,
)
from tiny_llama import engine
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from conveyor.engine.layers.moe import SparseMoeBlock
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.models import build_model
from conveyor.engine.quant_format import resolve_quant_format
from conveyor.engine.quantization import SmoothQuantConfig, smooth_quant, w8a8_quantization_config
from conveyor.engine.weight_loader import load_model
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.w8a8 import quant_per_token_ref
from conveyor.protocol.errors import EngineConfigError

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)


def _configs() -> dict[str, object]:
    return {
        "mixtral": MixtralConfig(**{**TINY, "intermediate_size": 64}, num_local_experts=4, sliding_window=6,
                                 **MOE, **IDS),
        # Layer 0 dense (128 wide), layer 1 sparse with a 64-wide gated shared expert.
        "qwen2_moe": Qwen2MoeConfig(**{**TINY, "intermediate_size": 128}, num_experts=4, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=64, mlp_only_layers=[0], norm_topk_prob=False,
                                    **MOE, **IDS),
        "qwen3_moe": Qwen3MoeConfig(**TINY, head_dim=32, num_experts=8, moe_intermediate_size=64,
                                    norm_topk_prob=True, **MOE, **IDS),
    }


def quantize_with_tool(config, root: Path) -> Path:
    """The tool's W8A8 checkpoint of a tiny random model of ``config``."""
    src = root / "hf"
    save_tiny(config, src)
    tokenizer().save_pretrained(src)
    (root / "calib.txt").write_text(text())
    smooth_quant(src, root / "w8a8", SmoothQuantConfig(calib_samples=4, calib_seqlen=32),
                 calib_dataset=root / "calib.txt", device="cpu", dtype="float32", progress=False)
    return root / "w8a8"


def dequantized_copy(w8a8_dir: Path, dense_dir: Path) -> Path:
    """The checkpoint with every int8 weight replaced by ``weight * weight_scale`` (fp32) and no
    quantization_config: what transformers loads as the reference's weights."""
    dense_dir.mkdir()
    state = load_file(w8a8_dir / "model.safetensors")
    out = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".weight_zero_point")):
            continue
        out[name] = t.float() * state[f"{name}_scale"].float() if t.dtype == torch.int8 else t.float()
    save_file(out, dense_dir / "model.safetensors")
    cfg = json.loads((w8a8_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    (dense_dir / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    return dense_dir


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x quantized per token (row) and read back: W8A8's activation rounding in float."""
    q, scale = quant_per_token_ref(x)
    return (q.float() * scale).view_as(x).to(x.dtype)


def w8a8_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                 ) -> torch.Tensor:
    """transformers' stacked experts' forward with W8A8's rounding: each token's input and each
    (token, expert)'s ``act(gate) * up`` quantized per row before its product."""
    out = torch.zeros_like(hidden_states)
    x = _fake_quant(hidden_states)
    for e in top_k_index.unique().tolist():
        if not 0 <= e < self.gate_up_proj.shape[0]:
            continue
        token, slot = torch.where(top_k_index == e)
        gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = _fake_quant(self.act_fn(gate) * up)
        out.index_add_(0, token, F.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None])
    return out


def simulated_w8a8(dense_dir: Path) -> torch.nn.Module:
    """transformers on the dequantized weights, every quantized linear's input and every expert's
    activations rounded as W8A8 rounds them; routers and the shared expert's gate read 16-bit rows."""
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    for name, module in hf.model.layers.named_modules():
        if hasattr(module, "gate_up_proj"):
            module.forward = types.MethodType(w8a8_experts, module)
        elif isinstance(module, torch.nn.Linear) and not name.endswith((".gate", "shared_expert_gate")):
            module.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0]),) + args[1:])
    return hf


def load_ours(path: Path) -> torch.nn.Module:
    """test_models.py's ``load_ours`` with the checkpoint's format resolved, as the engine does."""
    config = ModelConfig.from_pretrained(path)
    config.quant = resolve_quant_format(config, None)
    return load_model(build_model(config, dtype=torch.float32), path)


@pytest.fixture(scope="module", params=sorted(_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(the simulation, ours on the W8A8 files, the W8A8 directory)."""
    root = tmp_path_factory.mktemp(request.param)
    w8a8_dir = quantize_with_tool(_configs()[request.param], root)
    return simulated_w8a8(dequantized_copy(w8a8_dir, root / "dense")), load_ours(w8a8_dir), w8a8_dir


def test_experts_load_as_int8(tiny) -> None:
    """Each sparse block holds its experts as stacked int8 codes and fp32 scales whose products
    are the reference's expert weights; the router stays 16-bit and reads the norm's float rows."""
    hf, ours, _ = tiny
    assert ours.config.quant.method == "w8a8"
    layer = ours.model.layers[1]
    block = layer.mlp
    assert isinstance(block, SparseMoeBlock) and not layer.post_attention_layernorm.quantize_output
    experts = block.experts
    e, h, i = experts.num_experts, ours.config.hidden_size, experts.inter_size
    assert experts.w13.dtype == torch.int8 and tuple(experts.w13.shape) == (e, 2 * i, h)
    assert experts.w2_scale.dtype == torch.float32 and tuple(experts.w2_scale.shape) == (e, h)
    assert block.gate.weight.dtype == torch.float32
    ref = {n: p for n, p in hf.named_parameters() if "layers.1." in n and "experts" in n}
    gate_up = next(p for n, p in ref.items() if n.endswith("gate_up_proj"))
    down = next(p for n, p in ref.items() if n.endswith("down_proj"))
    torch.testing.assert_close(experts.w13.float() * experts.w13_scale[..., None], gate_up, rtol=0, atol=0)
    torch.testing.assert_close(experts.w2.float() * experts.w2_scale[..., None], down, rtol=0, atol=0)
    if ours.config.architecture == "Qwen2MoeForCausalLM":
        assert ours.model.layers[0].post_attention_layernorm.quantize_output  # the dense layer's MLP reads int8
        assert block.shared_expert.down_proj.weight.dtype == torch.int8
        assert block.shared_expert_gate.weight.dtype == torch.float32


def test_the_tool_writes_the_published_layout(tiny) -> None:
    """One int8 weight and scale per expert and projection under the published names (Mixtral's
    ``block_sparse_moe.experts.{e}.w1``), routers and the shared expert's gate in fp16 and in
    ``ignore``, no stacked expert tensor."""
    _, ours, path = tiny
    state = load_file(path / "model.safetensors")
    mixtral = ours.config.architecture == "MixtralForCausalLM"
    block, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj",
                                                                                     "down_proj"))
    for e in range(ours.config.num_experts):
        for proj in projs:
            name = f"model.layers.1.{block}.experts.{e}.{proj}"
            assert state[f"{name}.weight"].dtype == torch.int8 and state[f"{name}.weight_scale"].shape[1] == 1
    assert state[f"model.layers.1.{block}.gate.weight"].dtype == torch.float16
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in state)
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    assert f"re:.*{block}.gate$" in ignore
    if ours.config.architecture == "Qwen2MoeForCausalLM":
        assert state["model.layers.1.mlp.shared_expert_gate.weight"].dtype == torch.float16
        assert "re:.*shared_expert_gate$" in ignore
        assert state["model.layers.1.mlp.shared_expert.down_proj.weight"].dtype == torch.int8
        assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8  # the dense layer


def test_logits_match_the_simulation(tiny) -> None:
    """Prefills of several lengths, a two-sequence batch, prefill then decode, a chunked prefill."""
    hf, ours, _ = tiny
    check_prefills(hf, ours, (5, 13, 30))
    check_two_sequence_batch(hf, ours)
    check_prefill_then_decode(hf, ours)
    check_chunked_prefill(hf, ours)


def test_the_simulation_is_w8a8_not_the_float_model(tiny, tmp_path: Path) -> None:
    """The reference's rounding matters: without it the same weights give other logits (so the
    match above tests the activations' quantization, not only the weights')."""
    hf, _, path = tiny
    plain = AutoModelForCausalLM.from_pretrained(dequantized_copy(path, tmp_path / "dense"),
                                                 dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 9, 17, 33, 65, 7, 100, 4]])
    with torch.no_grad():
        diff = (hf(tokens).logits - plain(tokens).logits).abs().max().item()
    assert diff > 1e-3


def test_greedy_engine_batch_and_ppl_match(tiny) -> None:
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"], (50,))
    check_engine_batch_and_ppl(hf, path, IDS["eos_token_id"])


def test_tp2_matches_tp1(tiny) -> None:
    """Each rank holds every expert's slice of I (and the shared expert's and the dense layer's):
    tp=2 computes tp=1's model (CPU, gloo). Each rank quantizes its own slice of an intermediate
    row (a scale per slice, as the dense W8A8 o_proj and down_proj under tp do:
    test_tensor_parallel's W8A8 case), so the logprobs agree to that rounding, not to fp32's, and
    greedy tokens agree up to a step where tp=1's best two are that close (a near tie)."""
    from test_tensor_parallel import _run

    _, ours, path = tiny
    if ours.config.architecture != "Qwen2MoeForCausalLM":
        pytest.skip("one family: Qwen2-MoE has all three kinds of MLP")
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, 2)
    (tokens1, steps1), (tokens_tp, steps_tp) = trace1, trace_tp
    atol = 0.05
    for rid, want in tokens1.items():
        got = tokens_tp[rid]
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        for step1, step_tp in zip(steps1[rid][:same], steps_tp[rid][:same]):
            for tid in step1.keys() & step_tp.keys():
                assert step_tp[tid] == pytest.approx(step1[tid], abs=atol)
        if same < min(len(want), len(got)):  # a near tie, decided the other way
            step = steps1[rid][same]
            assert abs(step[want[same]] - step[got[same]]) < atol, (rid, same, step)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-2)


def write_rtn_w8a8(config, root: Path) -> Path:
    """A W8A8 checkpoint rounded to nearest here (no smoothing), as llm-compressor writes one:
    int8 ``weight``, fp16 ``weight_scale`` [out, 1] and zero ``weight_zero_point`` per linear and
    per expert, routers 16-bit and named in ``ignore``."""
    src = root / "hf"
    save_tiny(config, src)
    state = load_file(next(src.glob("*.safetensors")))
    out = {}
    for name, t in state.items():
        quantized = name.endswith(".weight") and "layers." in name and t.dim() == 2 and not name.endswith(
            (".gate.weight", "shared_expert_gate.weight", "norm.weight"))
        if not quantized:
            out[name] = t.half()
            continue
        q, scale = quant_per_token_ref(t)
        prefix = name.removesuffix(".weight")
        out.update({name: q, f"{prefix}.weight_scale": scale.half(),
                    f"{prefix}.weight_zero_point": torch.zeros_like(q[:, :1])})
    assert any(".experts.0." in n and n.endswith(".weight_scale") for n in out), "no per-expert tensor"
    (root / "w8a8").mkdir()
    save_file(out, root / "w8a8" / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    qc = w8a8_quantization_config(("re:.*block_sparse_moe.gate$", "re:.*mlp.gate$"))
    (root / "w8a8" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return root / "w8a8"


def test_a_round_to_nearest_checkpoint_loads(tmp_path: Path) -> None:
    """A Mixtral written here per expert (not by the tool; save_pretrained's per-expert names)
    computes the simulation on its weights."""
    w8a8_dir = write_rtn_w8a8(_configs()["mixtral"], tmp_path)
    hf = simulated_w8a8(dequantized_copy(w8a8_dir, tmp_path / "dense"))
    check_prefills(hf, load_ours(w8a8_dir), (5, 13))


def test_a_wrongly_shaped_expert_scale_is_named(tmp_path: Path) -> None:
    w8a8_dir = write_rtn_w8a8(_configs()["qwen3_moe"], tmp_path)
    state = load_file(w8a8_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.2.down_proj.weight_scale"
    state[name] = state[name][:1]
    save_file(state, w8a8_dir / "model.safetensors")
    with pytest.raises(ValueError, match="expert 2 down weight_scale"):
        load_ours(w8a8_dir)


def test_dummy_w8a8_experts_run(tmp_path: Path) -> None:
    """model_format='smooth_quant' with dummy weights (benchmarks) builds and fills int8 experts."""
    from tiny_llama import greedy

    cfg = _configs()["qwen3_moe"].to_dict()
    cfg.update(architectures=["Qwen3MoeForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = engine(tmp_path, model_format="smooth_quant", load_format="dummy")
    experts = eng.runner.model.model.layers[0].mlp.experts
    assert experts.w2.dtype == torch.int8 and experts.w2.float().std() > 50 and experts.w13.abs().max() <= 127
    assert len(greedy(eng, [1, 2, 3], 4)) == 4


@pytest.mark.parametrize("arch", ["DbrxForCausalLM", "DeepseekV2ForCausalLM"])
def test_w8a8_dbrx_and_deepseek_are_refused(arch: str) -> None:
    config = ModelConfig.from_dict({**_configs()["qwen3_moe"].to_dict(), "architectures": [arch],
                                    "quantization_config": w8a8_quantization_config()})
    with pytest.raises(EngineConfigError, match="serve its fp16/bf16 checkpoint"):
        resolve_quant_format(config, None)


def test_smoothing_keeps_the_moe_model_and_scales_the_router(tmp_path: Path) -> None:
    """The tool's smoothing of a Qwen2-MoE (dense layer, sparse block with a gated shared expert):
    one gate/up scale for the whole block, each routed-to expert's down projection, the shared
    down projection; the router and the shared expert's gate are multiplied by the block's scale,
    so the unquantized model (routing included) computes what it did."""
    from conveyor.engine.quantization import LayerwiseRunner
    from conveyor.engine.quantization.smooth_quant_tool import _record, smooth_layer

    hf = save_tiny(_configs()["qwen2_moe"], tmp_path / "hf")
    ids = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = hf(ids).logits
    block = hf.model.layers[1].mlp
    router, shared_gate = block.gate.weight.clone(), block.shared_expert_gate.weight.clone()
    runner = LayerwiseRunner(hf, ids, batch_size=4)
    largest = []
    for layer in runner.layers:
        outputs, absmax, routed = _record(runner, layer)
        largest.append(smooth_layer(layer, runner, absmax, 0.5, routed))
        runner.advance(outputs)
    assert {"qkv", "gate_up", "down"} <= set(largest[0])  # the dense layer
    assert {"qkv", "gate_up", "shared_down"} <= set(largest[1])
    assert any(k.startswith("down.") for k in largest[1])
    assert not torch.allclose(block.gate.weight, router) and not torch.allclose(block.shared_expert_gate.weight,
                                                                                shared_gate)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, before, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="the kernels run under Triton's interpreter on the CPU")
def test_the_kernel_path_computes_what_the_cpu_path_does() -> None:
    """The layer's GPU path (``fused_moe_w8a8``'s Triton kernels on its fp16 input, here under
    Triton's interpreter) against its CPU path (the integer reference), on dummy W8A8 experts with
    scales that differ by expert and channel."""
    from conveyor.engine.layers.moe import FusedMoE
    from conveyor.engine.model_runner import init_dummy_weights
    from conveyor.engine.quant_format import QuantFormat
    from conveyor.kernels.moe import select_experts

    layer = FusedMoE(4, 2, 64, 128, renormalize=True, quant=QuantFormat("w8a8", 8, -1))
    init_dummy_weights(layer, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in (layer.w13_scale, layer.w2_scale):
            p.copy_(torch.rand(p.shape, generator=g) * 0.002 + 0.0005)
    x = torch.randn(7, 64, generator=g).half()
    weights, ids = select_experts(torch.randn(7, 4, generator=g), 2, renormalize=True)
    ref = layer.method.apply(layer, x, weights, ids)
    set_kernel_mode("triton")
    try:
        out = layer.method.apply(layer, x, weights, ids)
    finally:
        set_kernel_mode("auto")
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-3, err
