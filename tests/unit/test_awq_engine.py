"""The engine on AWQ checkpoints (AutoAWQ "gemm" layout), on the CPU.

A tiny Llama is quantized here by plain round-to-nearest, packed with AutoAWQ's order
(kernels.w4a16.awq_pack, itself tested against AutoAWQ's documented packing), and written as an
AutoAWQ checkpoint would be. The engine must load it into the fused layers and compute exactly
what the dense model with the dequantized weights computes; wrong formats are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.kernels.w4a16 import awq_pack, awq_unpack
from conveyor.protocol import EngineConfigError

from tiny_llama import TINY, engine, greedy, random_tensors, write_checkpoint

GROUP = 32
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def rtn_awq(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit asymmetric per group of a dense [out, in] weight: the AWQ triple and
    the dense [out, in] weight it stands for."""
    w = weight.t().contiguous()  # [K, N]
    k, n = w.shape
    g = w.reshape(k // group, group, n)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale) + zero).clamp(0, 15)
    scales = scale.squeeze(1).to(torch.float16)
    dense = ((q - zero) * scales.float().unsqueeze(1)).reshape(k, n).t().contiguous()  # what fp16 scales give
    return awq_pack(q.reshape(k, n).int()), awq_pack(zero.squeeze(1).int()), scales, dense


def write_models(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """An AWQ checkpoint and the dense checkpoint of its dequantized weights."""
    common, linears = random_tensors(torch.Generator().manual_seed(seed))
    awq, dense = dict(common), dict(common)
    for prefix, weight in linears.items():
        qweight, qzeros, scales, w = rtn_awq(weight, GROUP)
        awq.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
        dense[f"{prefix}.weight"] = w
    return (write_checkpoint(root / "awq", awq, torch_dtype="float16", quantization_config=AWQ_CONFIG),
            write_checkpoint(root / "dense", dense))


def test_an_awq_checkpoint_computes_what_its_dequantized_weights_compute(tmp_path) -> None:
    awq_dir, dense_dir = write_models(tmp_path)
    awq, dense = engine(awq_dir), engine(dense_dir)
    assert awq.model_config.quant.method == "awq" and awq.model_config.quant.group_size == GROUP
    assert dense.model_config.quant is None
    layer = awq.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.qweight.dtype == torch.int32
    assert tuple(layer.self_attn.qkv_proj.qweight.shape) == (64, 128 // 8)  # q 64 + k 32 + v 32 outputs
    assert tuple(layer.mlp.down_proj.scales.shape) == (96 // GROUP, 64)
    # Every fused layer's dequantized weight is the dense one, shard by shard (placement by column).
    for fused, dense_layer in ((layer.self_attn.qkv_proj, dense.runner.model.model.layers[0].self_attn.qkv_proj),
                               (layer.mlp.gate_up_proj, dense.runner.model.model.layers[0].mlp.gate_up_proj)):
        fused.method.apply(fused, torch.zeros(1, fused.input_size))  # makes the CPU path's dense copy
        torch.testing.assert_close(fused.dense_cpu.t(), dense_layer.weight, rtol=0, atol=1e-6)
    for prompt in ([1, 2, 3], [5, 9, 17, 33, 65, 7, 100]):
        assert greedy(awq, prompt) == greedy(dense, prompt)


def test_dummy_awq_weights_run(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    eng = engine(tmp_path, model_format="awq", load_format="dummy")
    proj = eng.runner.model.model.layers[0].mlp.down_proj
    codes = awq_unpack(proj.qweight)
    assert codes.min() == 0 and codes.max() == 15 and (awq_unpack(proj.qzeros) == 8).all()
    assert len(greedy(eng, [1, 2, 3], 4)) == 4


@pytest.mark.parametrize("change, message", [
    (dict(model_format="awq", checkpoint="dense"), "conveyor lite auto_awq"),
    (dict(quantization_config={**AWQ_CONFIG, "bits": 8}), "only 4-bit"),
    (dict(quantization_config={**AWQ_CONFIG, "version": "gemv"}), "'gemm' layout"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quant_method='gptq'"),
    (dict(architectures=["InternLM2ForCausalLM"], model_type="internlm2"), "InternLM2ForCausalLM"),
])
def test_wrong_formats_are_refused_with_the_fix(tmp_path, change, message) -> None:
    awq_dir, dense_dir = write_models(tmp_path)
    change = dict(change)
    target = dense_dir if change.pop("checkpoint", None) == "dense" else awq_dir
    model_format = change.pop("model_format", None)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(EngineConfigError, match=message.replace("(", r"\(")):
        engine(target, model_format=model_format)


def test_an_explicit_format_that_contradicts_the_checkpoint_is_refused(tmp_path) -> None:
    from conveyor.engine.model_config import ModelConfig
    from conveyor.engine.quant_format import resolve_quant_format

    awq_dir, _ = write_models(tmp_path)
    config = ModelConfig.from_pretrained(awq_dir)
    with pytest.raises(EngineConfigError, match="model_format='awq' or None"):
        resolve_quant_format(config, "smooth_quant")
    assert resolve_quant_format(config, "hf").method == "awq"  # 'hf' means "as the checkpoint says"
