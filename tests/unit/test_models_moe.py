"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers: tiny random models (2 layers, hidden 64,
top-2 of 4-8 experts 32 wide) saved with ``save_pretrained``, loaded by the engine; float32 logits
within 1e-4, greedy tokens, the engine's batch and ``get_ppl`` (test_models.py's checks). Qwen2-MoE
has a gated shared expert and one dense layer (``mlp_only_layers``), Mixtral a 6-token window the
prompts cross. Also: tp=2 equals tp=1 (CPU, gloo), the stacked expert layout transformers 5 holds
in memory loads the same, AWQ checkpoints build packed experts, and the dummy shapes' parameter
counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import (
    TINY,
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
    save_tiny,
)
from tiny_llama import engine
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from conveyor.engine.layers.moe import SparseMoeBlock

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)


def _configs() -> dict[str, object]:
    return {
        # Every layer sparse, 8 experts of 32 (Mixtral's intermediate_size is the experts' width).
        "mixtral_window": MixtralConfig(**{**TINY, "intermediate_size": 32}, num_local_experts=8, sliding_window=6,
                                        **MOE, **IDS),
        # Layer 0 dense (96 wide), layer 1 sparse: 4 experts of 32 and a 48-wide gated shared expert;
        # top-k weights not renormalised (Qwen1.5-MoE's norm_topk_prob=False).
        "qwen2_moe_shared_dense": Qwen2MoeConfig(**TINY, num_experts=4, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48, mlp_only_layers=[0],
                                                 norm_topk_prob=False, **MOE, **IDS),
        "qwen3_moe": Qwen3MoeConfig(**TINY, head_dim=32, num_experts=8, moe_intermediate_size=32,
                                    norm_topk_prob=True, **MOE, **IDS),
    }


@pytest.fixture(scope="module", params=sorted(_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(HF reference model loaded back from disk, ours loaded from the same files, the directory)."""
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(_configs()[request.param], path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_ours(path), path


def test_logits_match_hf(tiny) -> None:
    """Prefills of several lengths, a two-sequence batch, prefill then decode, a chunked prefill."""
    hf, ours, _ = tiny
    check_prefills(hf, ours, (5, 13, 30))
    check_two_sequence_batch(hf, ours)
    check_prefill_then_decode(hf, ours)
    check_chunked_prefill(hf, ours)


def test_layers_are_sparse_or_dense_as_configured(tiny) -> None:
    """Qwen2-MoE's mlp_only_layers=[0] keeps layer 0 dense; the shared expert is only Qwen2-MoE's;
    Mixtral's window reaches every layer's attention."""
    _, ours, _ = tiny
    arch = ours.config.architecture
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert kinds == ([False, True] if arch == "Qwen2MoeForCausalLM" else [True, True])
    sparse = ours.model.layers[1].mlp
    assert (sparse.shared_expert is not None) == (arch == "Qwen2MoeForCausalLM")
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    assert windows == ([6, 6] if arch == "MixtralForCausalLM" else [None, None])


def test_greedy_engine_batch_and_ppl_match_hf(tiny) -> None:
    """Greedy decoding equals ``generate``; the engine's batch, prefix cache and get_ppl agree."""
    hf, _, path = tiny
    check_greedy_matches_generate(hf, path, IDS["eos_token_id"], (50, 51))
    check_engine_batch_and_ppl(hf, path, IDS["eos_token_id"])


def test_triton_kernels_match_hf(tiny) -> None:
    """The whole model in Triton mode (the MoE runs its reference until its kernel lands)."""
    hf, ours, _ = tiny
    check_triton_kernels(hf, ours)


def test_stacked_expert_layout_loads_the_same(tiny, tmp_path: Path) -> None:
    """transformers 5's in-memory layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I], Mixtral's ``mlp.`` prefix) gives the same logits as the per-expert files."""
    hf, _, path = tiny
    from safetensors.torch import load_file, save_file

    (file,) = path.glob("*.safetensors")
    state = load_file(file)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        parts = name.split(".")
        if ".experts." in name and parts[-3].isdigit():
            prefix = ".".join(parts[:-3]).replace(".block_sparse_moe.", ".mlp.")
            experts.setdefault(prefix, {}).setdefault(int(parts[-3]), {})[parts[-2]] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for prefix, by_expert in experts.items():
        rows = [by_expert[e] for e in sorted(by_expert)]
        gate, up, down = (("w1", "w3", "w2") if "w1" in rows[0] else ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([r[gate], r[up]]) for r in rows])
        out[f"{prefix}.down_proj"] = torch.stack([r[down] for r in rows])
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((path / "config.json").read_text())
    save_file(out, stacked / "model.safetensors")
    tokens = random_tokens(11, seed=7)
    from test_models import PagedCache

    assert_close(PagedCache(load_ours(stacked)).step({0: tokens})[0], hf_logits(hf, tokens))


def test_tp2_matches_tp1(tiny) -> None:
    """Each rank holds every expert's slice of the intermediate dim (and of the shared expert's and
    the dense layer's): tp=2 gives tp=1's greedy tokens and logprobs (CPU, gloo)."""
    from test_tensor_parallel import _run, _same

    _, ours, path = tiny
    if ours.config.architecture != "Qwen2MoeForCausalLM":
        pytest.skip("one family: Qwen2-MoE has all three kinds of MLP")
    (trace1, ppl1), (trace_tp, ppl_tp) = _run(path, 1), _run(path, 2)
    _same(trace1, trace_tp)
    assert ppl_tp == pytest.approx(ppl1, rel=1e-4)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_awq_checkpoint_builds_packed_experts(arch: str) -> None:
    """An AWQ config.json for an MoE family builds its experts as packed AWQ triples
    (test_models_moe_awq.py loads and runs such checkpoints against transformers); a W8A8 one as
    int8 codes and scales (test_models_moe_w8a8.py)."""
    from conveyor.engine.model_config import ModelConfig
    from conveyor.engine.models import build_model
    from conveyor.engine.quant_format import resolve_quant_format

    cfg = {"mixtral": _configs()["mixtral_window"], "qwen2moe": _configs()["qwen2_moe_shared_dense"],
           "qwen3moe": _configs()["qwen3_moe"]}[arch.removesuffix("ForCausalLM").lower()].to_dict()
    cfg.update(architectures=[arch], quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32,
                                                          "zero_point": True, "version": "gemm"})
    config = ModelConfig.from_dict(cfg)
    config.quant = resolve_quant_format(config, None)
    model = build_model(config, dtype=torch.float32, device="meta")
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_qweight.dtype == torch.int32 and not hasattr(experts, "w13")
    unquantized = ModelConfig.from_dict({k: v for k, v in cfg.items() if k != "quantization_config"})
    unquantized.quant = resolve_quant_format(unquantized, "smooth_quant", dummy_weights=True)
    experts = build_model(unquantized, dtype=torch.float32, device="meta").model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.int8 and experts.w13_scale.dtype == torch.float32


@pytest.mark.parametrize(("shape", "billions"), [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5)])
def test_dummy_shape_parameter_count(shape: str, billions: float) -> None:
    """The dummy shapes build on the meta device with the published models' parameter counts."""
    from conveyor.engine.dummy_model import shape_config
    from conveyor.engine.model_config import ModelConfig
    from conveyor.engine.models import build_model

    model = build_model(ModelConfig.from_dict(shape_config(shape)), dtype=torch.bfloat16, device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert count / 1e9 == pytest.approx(billions, abs=0.05)


# |get_ppl(quantized KV) - get_ppl(dense)| (nats): test_family_capabilities.py's bounds, int8's
# doubled: the tiny Qwen3-MoE errs 7.0e-3 on the second text (dense families at most 2.0e-3), where
# the cache's rounding moves one token's router logits across a near tie between two experts in
# each layer (seen by recording select_experts' ids): a discrete change a dense MLP cannot make.
KV_TOL = {8: 1e-2, 4: 1e-1}


@pytest.mark.parametrize("policy", [8, 4])
def test_quantized_kv_cache(tiny, policy: int) -> None:
    """KV int8 / int4 (``quant_policy``) keep get_ppl within the bounds every dense family meets:
    the experts change nothing in attention, the cache or its windows."""
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


@pytest.mark.parametrize(("shape", "total", "active"), [("mixtral-8x7b", 46.70, 12.88), ("qwen3-30b-a3b", 30.53, 3.35),
                                                        ("deepseek-v2-lite", 15.71, 2.66), ("llama2-7b", 6.74, 6.74)])
def test_param_count_total_and_active(shape: str, total: float, active: float) -> None:
    """``param_count`` counts the model built on the meta device; ``active=True`` counts top_k of
    E experts (the benchmarks' weight-read floor): Mixtral's published 46.7B / 12.9B."""
    from conveyor.engine.dummy_model import param_count

    assert param_count(shape) / 1e9 == pytest.approx(total, abs=0.01)
    assert param_count(shape, active=True) / 1e9 == pytest.approx(active, abs=0.01)


def test_param_count_is_the_whole_model_inside_a_tensor_parallel_rank() -> None:
    """A rank's layers are split; the count is still the model's (profile_step at tp=2 divided an
    already-halved count by tp again: a floor of 0.82 ms for Llama-2-7B's 1.63 on two H200s)."""
    from conveyor.engine.distributed import as_first_of
    from conveyor.engine.dummy_model import param_count

    whole = param_count("llama2-7b")
    with as_first_of(2):
        assert param_count("llama2-7b") == whole


def test_router_holds_float32_weights_in_any_model_dtype(tiny) -> None:
    """The router's weight is float32 after a bf16 build and load (no cast per step), holding the
    checkpoint's values (the tiny checkpoint is float32: not rounded to the model's bf16)."""
    from conveyor.engine.model_config import ModelConfig
    from conveyor.engine.models import build_model
    from conveyor.engine.weight_loader import load_model

    hf, _, path = tiny
    model = build_model(ModelConfig.from_dict(json.loads((path / "config.json").read_text())), dtype=torch.bfloat16)
    load_model(model, path)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.gate.weight.dtype == torch.float32 for b in blocks)
    ref = dict(hf.named_parameters())
    name = next(n for n in ref if n.endswith("mlp.gate.weight") or n.endswith("block_sparse_moe.gate.weight"))
    layer = int(name.split(".")[2])
    ours = next(m for i, m in enumerate(model.model.layers) if i == layer).mlp.gate.weight
    assert torch.equal(ours, ref[name])


def test_dummy_weights_set_every_norm_scale_to_one() -> None:
    """LayerNorm scales (DBRX, Falcon, StarCoder2) are 1 like RMSNorm's: at 0 every router input
    of a dummy DBRX is zero and each token goes to the same experts, which would skew MoE timings."""
    from transformers import DbrxConfig

    from conveyor.engine.layers import RMSNorm
    from conveyor.engine.layers.layer_norm import LayerNorm
    from conveyor.engine.model_config import ModelConfig
    from conveyor.engine.model_runner import init_dummy_weights
    from conveyor.engine.models import build_model

    cfg = DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
                     attn_config={"kv_n_heads": 2, "clip_qkv": 8.0},
                     ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})
    raw = {**cfg.to_dict(), "architectures": ["DbrxForCausalLM"]}
    model = build_model(ModelConfig.from_dict(raw), dtype=torch.float32)
    init_dummy_weights(model)
    norms = [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]
    assert norms and all(bool((m.weight == 1).all()) for m in norms)


def test_one_all_reduce_per_sparse_block(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse block sums routed and shared parts over the ranks in one all-reduce (the shared
    expert's down projection leaves its sum to the block): count the group's all-reduces of one
    forward. tp2 == tp1 (test_tp2_matches_tp1) checks the sum itself."""
    from conveyor.engine.distributed import TPGroup

    _, ours, _ = tiny
    blocks = [m for m in ours.modules() if isinstance(m, SparseMoeBlock)]
    calls = []
    original = TPGroup.all_reduce
    monkeypatch.setattr(TPGroup, "all_reduce", lambda self, x: calls.append(x.shape) or original(self, x))
    x = torch.randn(3, ours.config.hidden_size)
    for block in blocks:
        calls.clear()
        block(x)
        assert len(calls) == 1, (type(block.shared_expert).__name__, calls)
