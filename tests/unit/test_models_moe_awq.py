"""AWQ (W4A16) checkpoints of the mixture-of-experts families (Mixtral, Qwen2-MoE with its gated
shared expert and a dense layer, Qwen3-MoE) against transformers.

A tiny random model is saved with ``save_pretrained`` and quantized by ``conveyor lite auto_awq``
(group 32, a few calibration windows); ``dequantize_checkpoint`` writes the dense checkpoint of
its dequantized weights, which transformers loads. The engine on the AWQ files must give
transformers' fp32 logits within 1e-4, its greedy tokens, the engine checks of test_models.py,
and tp=2 the tokens of tp=1. Independently of the tool, a checkpoint packed here as AutoAWQ packs
(test_awq_engine.py's ``rtn_awq``: ``experts.{e}.w1.qweight`` / ``qzeros`` / ``scales`` ...;
router and shared-expert gate in 16 bits) loads the same way.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from calibration_models import text, tokenizer
from test_awq_engine import rtn_awq
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

from conveyor.engine.layers.moe import FusedMoE, SparseMoeBlock
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.models import build_model
from conveyor.engine.quant_format import QuantFormat, resolve_quant_format
from conveyor.engine.quantization import AwqConfig, auto_awq, dequantize_checkpoint, quantize
from conveyor.engine.weight_loader import load_model
from conveyor.kernels._triton import TRITON_INTERPRETED, set_kernel_mode
from conveyor.kernels.moe import select_experts
from conveyor.kernels.moe.reference_w4a16 import dequantize_experts_ref
from conveyor.protocol.errors import EngineConfigError

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

GROUP = 32
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)
# The linears AutoAWQ quantizes; the routers (``mlp.gate``, ``block_sparse_moe.gate``) and
# ``shared_expert_gate`` end otherwise and stay 16-bit.
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _configs() -> dict[str, object]:
    # Expert widths of 64: two groups of 32, so tp=2 leaves each rank one whole group.
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


def quantize_with_tool(config, root: Path, hf: torch.nn.Module | None = None) -> tuple[Path, Path, object]:
    """(the tool's AWQ checkpoint of a tiny model, the dense checkpoint of its dequantized weights,
    the tool's result); ``hf``: the model to save instead of a random one of ``config``."""
    src = root / "hf"
    if hf is None:
        save_tiny(config, src)
    else:
        hf.save_pretrained(src)
    tokenizer().save_pretrained(src)
    (root / "calib.txt").write_text(text())
    result = auto_awq(src, root / "awq", AwqConfig(w_group_size=GROUP, calib_samples=4, calib_seqlen=32),
                      calib_dataset=root / "calib.txt", device="cpu", dtype="float32", progress=False)
    return root / "awq", dequantize_checkpoint(root / "awq", root / "dense"), result


def write_awq(config, root: Path) -> tuple[Path, Path]:
    """(an AWQ checkpoint packed here by round-to-nearest, the dense checkpoint of its dequantized
    weights) of a tiny model."""
    dense_dir, awq_dir = root / "dense", root / "awq"
    save_tiny(config, dense_dir)
    (file,) = dense_dir.glob("*.safetensors")
    state = load_file(file)
    awq, dense = {}, {}
    for name, tensor in state.items():
        if not _QUANTIZED.search(name):
            awq[name] = dense[name] = tensor
            continue
        qweight, qzeros, scales, w = rtn_awq(tensor, GROUP)
        prefix = name.removesuffix(".weight")
        awq.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
        dense[name] = w
    assert any(".experts.0." in n and n.endswith(".qweight") for n in awq), "no expert was quantized"
    save_file(dense, file)
    awq_dir.mkdir()
    save_file(awq, awq_dir / "model.safetensors")
    cfg = json.loads((dense_dir / "config.json").read_text())
    (awq_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": AWQ_CONFIG}))
    return awq_dir, dense_dir


def load_ours(path: Path) -> torch.nn.Module:
    """test_models.py's ``load_ours`` with the checkpoint's format resolved, as the engine does."""
    config = ModelConfig.from_pretrained(path)
    config.quant = resolve_quant_format(config, None)
    return load_model(build_model(config, dtype=torch.float32), path)


@pytest.fixture(scope="module", params=sorted(_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(transformers on the dequantized weights, ours on the AWQ files, the AWQ directory)."""
    awq_dir, dense_dir, _ = quantize_with_tool(_configs()[request.param], tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    return hf, load_ours(awq_dir), awq_dir


def test_experts_load_packed(tiny) -> None:
    """Each sparse block holds its experts as stacked int32 triples whose dequantized values are
    transformers' expert weights; the router and the shared expert's gate stay 16-bit."""
    hf, ours, _ = tiny
    assert ours.config.quant.method == "awq" and ours.config.quant.group_size == GROUP
    block = ours.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    experts = block.experts
    e, h, i = experts.num_experts, ours.config.hidden_size, experts.inter_size
    assert not hasattr(experts, "w13")
    assert experts.w13_qweight.dtype == torch.int32 and tuple(experts.w13_qweight.shape) == (e, h, 2 * i // 8)
    assert tuple(experts.w2_scales.shape) == (e, i // GROUP, h)
    assert block.gate.weight.dtype == torch.float32 and not hasattr(block.gate, "qweight")
    if block.shared_expert_gate is not None:
        assert not hasattr(block.shared_expert_gate, "qweight")
    # Expert 1's dequantized gate rows, up rows and down projection are transformers' (dense) ones.
    w13 = dequantize_experts_ref(experts.w13_qweight, experts.w13_qzeros, experts.w13_scales, GROUP)
    w2 = dequantize_experts_ref(experts.w2_qweight, experts.w2_qzeros, experts.w2_scales, GROUP)
    ref = {n: p for n, p in hf.named_parameters() if "layers.1." in n and "experts" in n}
    gate_up = next(p for n, p in ref.items() if n.endswith("gate_up_proj"))
    down = next(p for n, p in ref.items() if n.endswith("down_proj"))
    torch.testing.assert_close(w13, gate_up.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(w2, down.float(), rtol=0, atol=1e-6)


def test_the_tool_writes_the_published_layout(tiny) -> None:
    """One triple per expert and projection under the published names (Mixtral's
    ``block_sparse_moe.experts.{e}.w1``), routers and the shared expert's gate in fp16, no stacked
    expert tensor."""
    _, ours, path = tiny
    names = set(load_file(path / "model.safetensors"))
    state = load_file(path / "model.safetensors")
    mixtral = ours.config.architecture == "MixtralForCausalLM"
    block, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj",
                                                                                     "down_proj"))
    for e in range(ours.config.num_experts):
        for proj in projs:
            assert {f"model.layers.1.{block}.experts.{e}.{proj}.{k}" for k in ("qweight", "qzeros", "scales")} <= names
    assert state[f"model.layers.1.{block}.gate.weight"].dtype == torch.float16
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in names)
    if ours.config.architecture == "Qwen2MoeForCausalLM":
        assert state["model.layers.1.mlp.shared_expert_gate.weight"].dtype == torch.float16
        assert "model.layers.1.mlp.shared_expert.down_proj.qweight" in names
        assert "model.layers.0.mlp.down_proj.qweight" in names  # the dense layer


def test_logits_match_hf(tiny) -> None:
    """Prefills of several lengths, a two-sequence batch, prefill then decode, a chunked prefill."""
    hf, ours, _ = tiny
    check_prefills(hf, ours, (5, 13, 30))
    check_two_sequence_batch(hf, ours)
    check_prefill_then_decode(hf, ours)
    check_chunked_prefill(hf, ours)


def test_greedy_engine_batch_and_ppl_match_hf(tiny) -> None:
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"], (50,))
    check_engine_batch_and_ppl(hf, path, IDS["eos_token_id"])


def test_tp2_matches_tp1(tiny) -> None:
    """Each rank holds every expert's group-aligned slice (and the shared expert's and the dense
    layer's): tp=2 gives tp=1's greedy tokens and logprobs (CPU, gloo)."""
    from test_tensor_parallel import _run, _same

    _, ours, path = tiny
    if ours.config.architecture != "Qwen2MoeForCausalLM":
        pytest.skip("one family: Qwen2-MoE has all three kinds of MLP")
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, 2)
    _same(trace1, trace_tp)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-4)


def test_an_expert_no_calibration_token_reaches_is_rounded_to_nearest(tmp_path: Path, caplog) -> None:
    """Routers whose rows are (r, -r, r', -r', 0) never pick expert 4 (its logit 0 is below the
    larger of a and -a and of b and -b): the tool searches experts 0-3 on their tokens, says that
    expert 4 gets round-to-nearest, rounds its down projection exactly so, and the checkpoint
    still runs as its dequantized weights do."""
    config = MixtralConfig(**{**TINY, "intermediate_size": 64}, num_local_experts=5, **MOE, **IDS)
    hf = save_tiny(config, tmp_path / "random")
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.mlp.gate.weight
            w[1], w[3], w[4] = -w[0], -w[2], 0.0
    downs = [layer.mlp.experts.down_proj[4].clone() for layer in hf.model.layers]
    # The tool's own logger: an earlier pipeline() in the same process may have set "conveyor"'s
    # level to WARNING, which a root-level at_level would not lift.
    with caplog.at_level(logging.INFO, logger="conveyor.engine.quantization.awq_tool"):
        awq_dir, dense_dir, result = quantize_with_tool(None, tmp_path, hf)
    for i, report in enumerate(result.layers):
        assert sorted(k for k in report.alphas if k.startswith("down.")) == [f"down.{e}" for e in range(4)]
        assert f"layer {i}: no calibration token reaches expert(s) [4]: round-to-nearest" in caplog.text
    dense = load_file(dense_dir / "model.safetensors")
    for i, down in enumerate(downs):
        rtn = quantize(down, 4, GROUP).dequantize()
        torch.testing.assert_close(dense[f"model.layers.{i}.block_sparse_moe.experts.4.w2.weight"], rtn,
                                   rtol=0, atol=0)
    ref = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    check_prefills(ref, load_ours(awq_dir), (5, 13))


def test_an_autoawq_packed_checkpoint_loads(tmp_path: Path) -> None:
    """A Mixtral packed here as AutoAWQ packs (not by the tool) computes its dequantized weights."""
    awq_dir, dense_dir = write_awq(_configs()["mixtral"], tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    check_prefills(ref, load_ours(awq_dir), (5, 13))


def _qwen3_dir(root: Path, **change) -> Path:
    # intermediate_size 128 (unused by the sparse layers, but checked for tp) splits into whole groups.
    awq_dir, _ = write_awq(Qwen3MoeConfig(**{**TINY, "intermediate_size": 128}, head_dim=32, num_experts=4,
                                          moe_intermediate_size=64, **MOE, **IDS), root)
    if change:
        cfg = json.loads((awq_dir / "config.json").read_text())
        (awq_dir / "config.json").write_text(json.dumps({**cfg, **change}))
    return awq_dir


def test_a_tp_that_splits_a_group_is_refused_before_loading(tmp_path: Path) -> None:
    """tp=4 leaves each rank 16 of the experts' 64 columns, half a group: refused by name when
    the model is built on the meta device, before any rank starts or reads a weight."""
    with pytest.raises(EngineConfigError, match=r"tp=4 .*16 .*group_size 32"):
        engine(_qwen3_dir(tmp_path), tp=4)


def test_a_wrongly_shaped_expert_tensor_is_named(tmp_path: Path) -> None:
    awq_dir = _qwen3_dir(tmp_path)
    state = load_file(awq_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.2.down_proj.scales"
    state[name] = state[name][:1]
    save_file(state, awq_dir / "model.safetensors")
    with pytest.raises(ValueError, match="expert 2 down scales"):
        load_ours(awq_dir)


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="the packed path runs Triton's interpreter on the CPU")
@pytest.mark.parametrize("group", [32, 64])
def test_the_packed_path_computes_what_the_cpu_path_does(group: int) -> None:
    """The layer's GPU path (``fused_moe_w4a16`` on its packed fp16 weights, here under Triton's
    interpreter) against its CPU path (the dequantized experts), on dummy AWQ weights."""
    from conveyor.engine.model_runner import init_dummy_weights

    torch.set_default_dtype(torch.float16)
    try:
        layer = FusedMoE(4, 2, 64, 128, renormalize=True, quant=QuantFormat("awq", 4, group))
    finally:
        torch.set_default_dtype(torch.float32)
    init_dummy_weights(layer, seed=3)
    assert layer.w13_scales.dtype == torch.float16
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # zeros and scales that differ by expert, group and column
        for p in (layer.w13_qzeros, layer.w2_qzeros):
            p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=g, dtype=torch.int64).to(torch.int32))
        for p in (layer.w13_scales, layer.w2_scales):
            p.copy_(torch.rand(p.shape, generator=g) * 0.01 + 0.002)
    layer.dense_cpu = None
    x = torch.randn(7, 64, generator=g).half()
    weights, ids = select_experts(torch.randn(7, 4, generator=g), 2, renormalize=True)
    ref = layer.method.apply(layer, x, weights, ids)
    set_kernel_mode("triton")
    try:
        out = layer.method.apply_packed(layer, x, weights, ids)
    finally:
        set_kernel_mode("auto")
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-3, err


def test_dummy_awq_experts_run(tmp_path: Path) -> None:
    """model_format='awq' with dummy weights (benchmarks) builds and fills packed experts."""
    from conveyor.kernels.w4a16 import awq_unpack
    from tiny_llama import greedy

    cfg = _configs()["qwen3_moe"].to_dict()
    cfg.update(architectures=["Qwen3MoeForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = engine(tmp_path, model_format="awq", load_format="dummy")
    experts = eng.runner.model.model.layers[0].mlp.experts
    codes = awq_unpack(experts.w2_qweight[3])
    assert codes.min() == 0 and codes.max() == 15 and (awq_unpack(experts.w13_qzeros[0]) == 8).all()
    assert len(greedy(eng, [1, 2, 3], 4)) == 4
