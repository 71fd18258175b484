"""The engine on W8A8 checkpoints (compressed-tensors int8 layout), on the CPU.

A tiny Llama's linears are rounded to int8 per output channel and written as llm-compressor
writes a W8A8 checkpoint (int8 ``weight``, ``weight_scale`` [out, 1] in float16, all-zero
``weight_zero_point``). The engine must compute what the dense model with the dequantized weights
computes when every linear's input is quantized per token first: that model is the dense engine
with its linear method's inputs fake-quantized (``quant_per_token_ref`` and back), so the only
differences are float rounding. The norms hand q/k/v and gate/up their input already quantized
(``Int8Rows``); o_proj and down_proj quantize theirs. Wrong formats are refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_llama import engine, greedy, random_tensors, write_checkpoint

from conveyor.engine.layers import linear as linear_module
from conveyor.engine.layers.w8a8_linear import Int8Rows
from conveyor.engine.quantization import w8a8_quantization_config
from conveyor.kernels.w8a8 import quant_per_token_ref
from conveyor.protocol import EngineConfigError

W8A8_CONFIG = w8a8_quantization_config()
PROMPTS = ([1, 2, 3], [5, 9, 17, 33, 65, 7, 100, 4, 8, 12, 16, 20, 24])


def write_models(root: Path, seed: int = 0, zero_point: int = 0) -> tuple[Path, Path]:
    """A W8A8 checkpoint and the dense checkpoint of its dequantized weights."""
    common, linears = random_tensors(torch.Generator().manual_seed(seed))
    w8a8, dense = dict(common), dict(common)
    for prefix, weight in linears.items():
        q, scale = quant_per_token_ref(weight)
        scale = scale.half()  # llm-compressor stores scales in the model's dtype
        w8a8.update({f"{prefix}.weight": q, f"{prefix}.weight_scale": scale,
                     f"{prefix}.weight_zero_point": torch.full_like(q[:, :1], zero_point)})
        dense[f"{prefix}.weight"] = q.float() * scale.float()
    return (write_checkpoint(root / "w8a8", w8a8, torch_dtype="float16", quantization_config=W8A8_CONFIG),
            write_checkpoint(root / "dense", dense))


@pytest.fixture
def fake_quantized_inputs(monkeypatch):
    """Dense linears whose inputs are quantized per token and read back: W8A8's arithmetic in float."""
    dense_apply = linear_module.UnquantizedLinearMethod.apply

    def apply(self, layer, x):
        q, scale = quant_per_token_ref(x)
        return dense_apply(self, layer, (q.float() * scale).view_as(x).to(x.dtype))

    monkeypatch.setattr(linear_module.UnquantizedLinearMethod, "apply", apply)


def test_a_w8a8_checkpoint_loads_into_the_fused_layers(tmp_path) -> None:
    w8a8_dir, dense_dir = write_models(tmp_path)
    eng = engine(w8a8_dir)
    assert eng.model_config.quant.method == "w8a8" and eng.model_config.quant.model_format == "smooth_quant"
    layer = eng.runner.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and tuple(qkv.weight.shape) == (128, 64)
    assert qkv.weight_scale.dtype == torch.float32 and tuple(qkv.weight_scale.shape) == (128, 1)
    dense_qkv = engine(dense_dir).runner.model.model.layers[0].self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv.weight.float() * qkv.weight_scale, dense_qkv, rtol=0, atol=0)
    assert layer.input_layernorm.quantize_output and layer.post_attention_layernorm.quantize_output
    assert not eng.runner.model.model.norm.quantize_output  # the LM head reads 16-bit activations
    assert isinstance(layer.input_layernorm(torch.randn(3, 64)), Int8Rows)


def test_w8a8_computes_the_dense_model_on_per_token_quantized_inputs(tmp_path, fake_quantized_inputs) -> None:
    w8a8_dir, dense_dir = write_models(tmp_path)
    w8a8, fake = engine(w8a8_dir), engine(dense_dir)
    for prompt in PROMPTS:
        assert greedy(w8a8, prompt) == greedy(fake, prompt)
    losses, fake_losses = w8a8.get_ppl(list(PROMPTS)), fake.get_ppl(list(PROMPTS))
    for loss, ref in zip(losses, fake_losses):
        assert math.isclose(loss, ref, rel_tol=1e-5), (loss, ref)


def test_w8a8_activations_are_really_quantized(tmp_path) -> None:
    w8a8_dir, dense_dir = write_models(tmp_path)
    losses, dense_losses = engine(w8a8_dir).get_ppl(list(PROMPTS)), engine(dense_dir).get_ppl(list(PROMPTS))
    # Without the fake quantization the dense model differs by int8 activation rounding (~1e-3 relative).
    assert any(abs(loss - ref) > 1e-5 * ref for loss, ref in zip(losses, dense_losses))
    assert all(math.isclose(loss, ref, rel_tol=0.05) for loss, ref in zip(losses, dense_losses))


def test_dummy_w8a8_weights_run(tmp_path) -> None:
    write_checkpoint(tmp_path / "m", {})
    eng = engine(tmp_path / "m", model_format="smooth_quant", load_format="dummy")
    proj = eng.runner.model.model.layers[0].mlp.down_proj
    assert proj.weight.dtype == torch.int8 and proj.weight.abs().max() <= 127 and proj.weight.float().std() > 50
    assert len(greedy(eng, [1, 2, 3], 4)) == 4


def _group(**changes) -> dict:
    group = W8A8_CONFIG["config_groups"]["group_0"]
    weights = {**group["weights"], **changes.pop("weights", {})}
    inputs = {**group["input_activations"], **changes.pop("input_activations", {})}
    return {**W8A8_CONFIG, **changes,
            "config_groups": {"group_0": {**group, "weights": weights, "input_activations": inputs}}}


@pytest.mark.parametrize("change, message", [
    (dict(model_format="smooth_quant", checkpoint="dense"), "conveyor lite smooth_quant"),
    (dict(model_format="awq"), "pass model_format='smooth_quant' or None"),
    (dict(quantization_config=_group(input_activations={"dynamic": False})), "input_activations.dynamic"),
    (dict(quantization_config=_group(weights={"strategy": "tensor"})), "weights.strategy"),
    (dict(quantization_config=_group(weights={"num_bits": 4})), "weights.num_bits"),
    (dict(quantization_config={**W8A8_CONFIG, "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}),
     "unquantized"),
    (dict(zero_point=3), "non-zero zero points"),
    (dict(architectures=["InternLM2ForCausalLM"], model_type="internlm2"), "InternLM2ForCausalLM"),
])
def test_wrong_w8a8_formats_are_refused_with_the_fix(tmp_path, change, message) -> None:
    change = dict(change)
    w8a8_dir, dense_dir = write_models(tmp_path, zero_point=change.pop("zero_point", 0))
    target = dense_dir if change.pop("checkpoint", None) == "dense" else w8a8_dir
    model_format = change.pop("model_format", None)
    if change:
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(EngineConfigError, match=message.replace("(", r"\(")):
        engine(target, model_format=model_format)



@pytest.mark.gpu
def test_w8a8_on_the_gpu_matches_the_cpu(tmp_path) -> None:
    """The Triton path (fused norm + quantization, int8 GEMM, CUDA graphs for decode) against the CPU
    reference path on the same checkpoint: per-sequence losses agree to fp16 accuracy."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine

    w8a8_dir, _ = write_models(tmp_path)
    gpu = LLMEngine(w8a8_dir, EngineConfig(device="cuda", dtype="float16", cache_max_entry_count=64, block_size=16,
                                           max_batch_size=8, max_prefill_token_num=256))
    cpu = engine(w8a8_dir)
    assert gpu.runner.model.model.layers[0].self_attn.qkv_proj.weight.is_cuda
    for loss, ref in zip(gpu.get_ppl(list(PROMPTS)), cpu.get_ppl(list(PROMPTS))):
        assert math.isclose(loss, ref, rel_tol=2e-2), (loss, ref)
    assert len(greedy(gpu, PROMPTS[1], 16)) == 16  # decode through the captured graphs


def test_a_checkpoint_missing_a_scale_is_refused_by_name(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from conveyor.protocol.errors import UnsupportedModelError

    w8a8_dir, _ = write_models(tmp_path)
    tensors = load_file(str(w8a8_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(w8a8_dir / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        engine(w8a8_dir)
