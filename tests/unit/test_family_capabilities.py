"""Every model family against every serving capability docs/model_support.md claims for it.

One table (FAMILIES): per family, how its tiny checkpoint is built (a transformers config saved
by ``save_tiny``, or, for the remote-code families, the parity tests' own converter into the
family's published layout) and which capabilities it claims or is refused. One test per
capability runs over the families that claim it; a refusal is tested as the error it raises.

- KV int8 / int4 (``quant_policy`` 8 / 4): the engine's ``get_ppl`` on two random 30-token texts
  is within one tolerance per policy (measured on the Llama layout, the same for every family)
  of the 16-bit cache's, and greedy decoding runs and gives every block back.
- tp=2 (CPU, gloo): greedy tokens equal tp=1's and ``get_ppl`` is within 1e-4 (float32).
- W8A8 (``conveyor lite smooth_quant``) and W4A16 (``conveyor lite auto_awq``): the tool
  quantizes the tiny model (calibrated on random token windows), the engine loads the result, and
  its ``get_ppl`` on other random texts is within a tolerance of the dense model's.
- The tools' layouts (``engine/quantization/layouts.py``): for every family they know, random
  scales folded into every scale group keep transformers' logits; where the engine reads no
  quantized weights for the family, it refuses the tool's checkpoint by name, and the checkpoint's
  dequantized weights serve within the same bound. Families the tools do not know are refused by
  the tools, naming the family, before any model is loaded.

fp16/bf16 is not tested here: the parity tests in ``test_models*.py`` back it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import transformers
import torch
from safetensors.torch import load_file, save_file
from test_models import TINY, pack_internlm2, random_tokens, save_tiny
from test_models_glm_starcoder_falcon import FALCON, to_chatglm
from test_models_deepseek_moe import deepseek_v1
from test_models_deepseek_v2 import tiny_configs as deepseek_v2_configs
from test_models_remote_code_families import baichuan, baichuan2, internlm, qwen
from tiny_llama import engine
from transformers import (
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    GlmConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Starcoder2Config,
)

from conveyor.engine.quantization import (
    AwqConfig,
    LayerwiseRunner,
    QuantizationError,
    SmoothQuantConfig,
    auto_awq,
    calibration_windows,
    load_causal_lm,
    smooth_quant,
    tool_run,
)
from conveyor.engine.quantization.scale_groups import apply_scale, scale_groups
from conveyor.protocol import EngineConfigError
from conveyor.protocol.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 6  # the windowed families' window: the 30-token texts cross it

# Capabilities, as docs/model_support.md's columns name them.
KV8, KV4, TP, W4A16, W8A8 = "kv_int8", "kv_int4", "tp", "w4a16", "w8a8"

# |get_ppl(quantized) - get_ppl(dense)| on the two held-out texts (mean NLL in nats, about 5 on
# these random models), one bound per capability for every family: 2.5 times the worst the Llama
# layout gave over 6 to 8 random seeds (int8 KV 2.0e-3, int4 KV 4.0e-2, the tools' W8A8 6.0e-3 and
# W4A16 7.7e-2, rounded up).
KV_TOL = {8: 5e-3, 4: 1e-1}
W8A8_TOL = 1.5e-2
W4A16_TOL = 2e-1
TP_TOL = 1e-4


def _pretrained(config, architecture: str | None = None, norm_offset: float = 0.0) -> Callable[[Path], None]:
    """A builder saving a random transformers model of ``config`` (``architecture``: the name the
    family's released config.json carries, where transformers' class writes another).

    ``save_tiny`` draws every norm weight near 1, which is a norm near 1 for ``x * w`` but near 2
    for Gemma's ``x * (norm_offset + w)``: logits twice as sharp, on which every quantized path
    errs several times more than on the others. ``norm_offset`` takes it off again, so that each
    family's norms scale by about 1 and one bound per capability fits all."""
    def build(path: Path) -> None:
        save_tiny(config, path)
        if norm_offset:
            tensors = load_file(str(path / "model.safetensors"))
            save_file({k: t - norm_offset if "norm" in k else t for k, t in tensors.items()},
                      str(path / "model.safetensors"), metadata={"format": "pt"})
        if architecture:
            cfg = json.loads((path / "config.json").read_text())
            cfg["architectures"] = [architecture]
            (path / "config.json").write_text(json.dumps(cfg))
    return build


def _chatglm(path: Path) -> None:
    hf = save_tiny(GlmConfig(**TINY, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5}, **IDS), path / "glm")
    to_chatglm(hf, path)


def _internlm2(path: Path) -> None:
    """A Llama repacked into InternLM2's names and head-interleaved wqkv (test_models.pack_internlm2)."""
    hf = save_tiny(LlamaConfig(**TINY, **IDS), path / "llama")
    heads, kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    save_file(pack_internlm2(hf.state_dict(), heads, kv_heads, TINY["hidden_size"] // heads),
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        **{k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "vocab_size", "max_position_embeddings")},
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False,
        "rms_norm_eps": hf.config.rms_norm_eps, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", **IDS}))


def _remote(convert: Callable[[Path], object]) -> Callable[[Path], None]:
    """A builder from a remote-code family's converter (test_models_remote_code_families), which
    writes the checkpoint and returns the equivalent transformers model (not needed here)."""
    def build(path: Path) -> None:
        convert(path)
    return build


@dataclass(frozen=True)
class Family:
    """How to build the family's tiny checkpoint, what it claims, and what it is refused (capability
    -> a pattern of the error's message)."""

    build: Callable[[Path], None]
    claims: frozenset[str]
    refused: dict[str, str] = field(default_factory=dict)


KV = frozenset({KV8, KV4})
# The quantization tools know the family's decoder layout (engine/quantization/layouts.py):
# they quantize it, and its scale folding keeps the model's function.
TOOL = "tool_layout"
SERVED = frozenset({W8A8, W4A16, TOOL})  # ... and the engine serves what they write
NOT_BY_TOOLS = {TOOL: "supports model types"}

GEMMA2 = Gemma2Config(**TINY, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                      attn_logit_softcapping=2.0, final_logit_softcapping=5.0, **IDS)

FAMILIES: dict[str, Family] = {
    "llama": Family(_pretrained(LlamaConfig(**TINY, **IDS)), KV | SERVED | {TP}),
    "mistral": Family(_pretrained(MistralConfig(**TINY, sliding_window=None, **IDS)), KV | SERVED | {TP}),
    "mistral_window": Family(_pretrained(MistralConfig(**TINY, sliding_window=WINDOW, **IDS)), KV | {TP}),
    "qwen2": Family(_pretrained(Qwen2Config(**TINY, **IDS)), KV | SERVED | {TP}),
    "internlm2": Family(_internlm2, KV | {TP}, NOT_BY_TOOLS),
    "qwen3": Family(_pretrained(Qwen3Config(**TINY, head_dim=32, **IDS)), KV | SERVED | {TP}),
    "internlm3": Family(_pretrained(transformers.InternLM3Config(**TINY, head_dim=32, **IDS), "InternLM3ForCausalLM"),
                        KV | SERVED | {TP}),
    "olmo2": Family(_pretrained(Olmo2Config(**TINY, **IDS)), KV,
                    {**NOT_BY_TOOLS, TP: "Olmo2ForCausalLM runs at tp=1 only"}),
    "gemma": Family(_pretrained(GemmaConfig(**TINY, head_dim=32, **IDS), norm_offset=1.0), KV | SERVED | {TP}),
    # A soft cap of 2 bends these random scores (Gemma 2 ships 50).
    "gemma2": Family(_pretrained(GEMMA2, norm_offset=1.0), KV | SERVED | {TP}),
    # The same with save_tiny's norms near 2: scores large enough for the cap to matter to a
    # quantized cache (keys stored centred lost 0.04 nats here while the cap ignored the centre).
    "gemma2_sharp_capped": Family(_pretrained(GEMMA2), KV),
    "gemma3": Family(_pretrained(Gemma3TextConfig(
        **TINY, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **IDS), norm_offset=1.0),
        KV | SERVED | {TP}),
    "phi3": Family(_pretrained(Phi3Config(**TINY, sliding_window=None, original_max_position_embeddings=256, **IDS)),
                   KV | {TP}, NOT_BY_TOOLS),
    "glm": Family(_pretrained(GlmConfig(**TINY, head_dim=16, **IDS)), KV | {TP}, NOT_BY_TOOLS),
    "glm4": Family(_pretrained(Glm4Config(**TINY, head_dim=16, **IDS)), KV | {TP}, NOT_BY_TOOLS),
    "chatglm": Family(_chatglm, KV | {TP}, NOT_BY_TOOLS),
    "starcoder2": Family(_pretrained(Starcoder2Config(**TINY, sliding_window=8, **IDS)), KV | {TP}, NOT_BY_TOOLS),
    # Falcon-7B's layout: one kv head, attention and MLP side by side on one LayerNorm, tied head.
    "falcon_7b_mqa": Family(_pretrained(FalconConfig(**FALCON)), KV | {TP}, NOT_BY_TOOLS),
    # Falcon-40B/180B's: 2 kv heads, query_key_value rows per kv group, ln_attn + ln_mlp, untied head.
    "falcon_40b_grouped": Family(_pretrained(FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2,
                                                          tie_word_embeddings=False)), KV | {TP}, NOT_BY_TOOLS),
    "falcon_rw_alibi": Family(_pretrained(FalconConfig(**FALCON, alibi=True, multi_query=False, parallel_attn=False,
                                                       bias=True)), KV | {TP}, NOT_BY_TOOLS),
    "internlm": Family(_remote(internlm), KV | {TP}, NOT_BY_TOOLS),
    "qwen": Family(_remote(qwen), KV | {TP}, NOT_BY_TOOLS),
    "baichuan": Family(_remote(baichuan), KV | {TP}, NOT_BY_TOOLS),
    "baichuan2": Family(_remote(baichuan2), KV | {TP}, NOT_BY_TOOLS),
    # DeepSeek-MoE v1's layout: a dense layer 0, then 8 routed experts (top-3) and 2 shared ones.
    "deepseek_moe": Family(_remote(lambda path: deepseek_v1("v1", path)), KV | {TP}, NOT_BY_TOOLS),
    # DeepSeek-V2: MLA over a latent cache (no quantized layout: quant_policy 8/4 refused, tested in
    # test_models_deepseek_v2.py), a dense layer 0, then 4 routed experts (grouped top-2) and a shared one.
    "deepseek_v2": Family(_pretrained(deepseek_v2_configs()["moe"]), frozenset({TP}), NOT_BY_TOOLS),
}

TEXTS = [random_tokens(30, seed=101), random_tokens(30, seed=102)]
PROMPTS = [random_tokens(7, seed=201), random_tokens(12, seed=202)]
NEW_TOKENS = 8


def _claiming(capability: str) -> list[str]:
    return [name for name, fam in FAMILIES.items() if capability in fam.claims]


def _refusing(capability: str) -> list[str]:
    return [name for name, fam in FAMILIES.items() if capability in fam.refused]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """Each family's tiny checkpoint, built once for the module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            FAMILIES[name].build(path)
            built[name] = path
        return built[name]
    return get


def _run(path: Path, **kw) -> tuple[list[float], list[list[int]]]:
    """``get_ppl`` of TEXTS and greedy tokens after PROMPTS (batched) through one engine, with the
    prefix cache on; asserts that every block is free again at the end."""
    eng = engine(path, enable_prefix_caching=True, **kw)
    try:
        ppl = eng.get_ppl(TEXTS)
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0), request_id=str(i))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while eng.has_work:
            for out in eng.step():
                if out.token is not None:
                    tokens[out.request_id].append(out.token)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "a block was left taken"
    finally:
        eng.close()
    for rid, toks in tokens.items():
        assert 0 < len(toks) <= NEW_TOKENS, f"request {rid} gave {len(toks)} tokens"
    return ppl, [tokens[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def dense(model_dir) -> Callable[[str], tuple[list[float], list[list[int]]]]:
    """Each family's 16-bit-cache tp=1 run (``_run``), once for the module: every capability's reference."""
    done: dict[str, tuple[list[float], list[list[int]]]] = {}

    def get(name: str) -> tuple[list[float], list[list[int]]]:
        if name not in done:
            done[name] = _run(model_dir(name))
        return done[name]
    return get


def _assert_ppl_close(got: list[float], ref: list[float], tol: float) -> None:
    diffs = [abs(a - b) for a, b in zip(got, ref, strict=True)]
    assert max(diffs) < tol, f"get_ppl {got} vs {ref}: differences {diffs}, tolerance {tol}"


# ---- KV cache int8 / int4 ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", [8, 4])
@pytest.mark.parametrize("name", _claiming(KV8))
def test_quantized_kv_cache(name: str, policy: int, model_dir, dense) -> None:
    if (KV8 if policy == 8 else KV4) not in FAMILIES[name].claims:
        pytest.skip(f"{name} does not claim quant_policy={policy}")
    ppl, _ = _run(model_dir(name), quant_policy=policy)
    _assert_ppl_close(ppl, dense(name)[0], KV_TOL[policy])


def test_quantized_kv_cache_refuses_an_odd_head_dim(tmp_path: Path) -> None:
    """The only shape the quantized cache refuses (its codes are laid out in two halves). RoPE
    needs an even head_dim anyway, so only an ALiBi model can have one: a falcon-rw with 15, its
    config.json written by hand (transformers' config checks RoPE's dims even where ALiBi replaces
    it) and dummy weights."""
    config = FalconConfig(**FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True).to_dict()
    config.update(hidden_size=60, architectures=["FalconForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineConfigError, match="even head_dim"):
        engine(tmp_path, quant_policy=8, load_format="dummy")


# ---- tensor parallel ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", _claiming(TP))
def test_tp2_equals_tp1(name: str, model_dir, dense) -> None:
    ppl, tokens = _run(model_dir(name), tp=2)
    ref_ppl, ref_tokens = dense(name)
    assert tokens == ref_tokens
    _assert_ppl_close(ppl, ref_ppl, TP_TOL)


@pytest.mark.parametrize("name", _refusing(TP))
def test_tp2_refused(name: str, model_dir) -> None:
    with pytest.raises(EngineConfigError, match=FAMILIES[name].refused[TP]):
        engine(model_dir(name), tp=2)


# ---- W8A8 (SmoothQuant) and W4A16 (AWQ) through the tools ----------------------------------------


@pytest.fixture
def random_calibration(monkeypatch, tmp_path: Path) -> Path:
    """The tools calibrate on windows of random token ids (seeds apart from TEXTS'): the tiny models
    have no tokenizer of their own, and transformers would swap a word-level stand-in for the
    family's own tokenizer class (Qwen2's byte-level BPE folds its words into a few ids). The tools
    still read and check the calibration file named here; its text goes unused."""
    def windows(model_dir, text, num_samples, seqlen):
        ids = random_tokens(num_samples * seqlen, seed=301)
        return calibration_windows(ids, num_samples, seqlen)

    monkeypatch.setattr(tool_run, "model_windows", windows)
    calib = tmp_path / "calib.txt"
    calib.write_text("random token windows stand in for this text")
    return calib


def _quantize(tool: str, src: Path, out: Path, calib: Path | None) -> None:
    if tool == W8A8:
        smooth_quant(src, out, SmoothQuantConfig(calib_samples=8, calib_seqlen=32), calib, device="cpu",
                     dtype="float32", progress=False)
    else:
        auto_awq(src, out, AwqConfig(w_group_size=32, calib_samples=8, calib_seqlen=32, n_grid=10), calib,
                 device="cpu", dtype="float32", progress=False)


@pytest.mark.parametrize("tool", [W8A8, W4A16])
@pytest.mark.parametrize("name", _claiming(W8A8))
def test_quantization_tool_output_serves_close_to_dense(name: str, tool: str, model_dir, dense,
                                                        random_calibration: Path, tmp_path: Path) -> None:
    if tool not in FAMILIES[name].claims:
        pytest.skip(f"{name} does not claim {tool}")
    _quantize(tool, model_dir(name), tmp_path / tool, random_calibration)
    ppl, _ = _run(tmp_path / tool)
    _assert_ppl_close(ppl, dense(name)[0], W8A8_TOL if tool == W8A8 else W4A16_TOL)


@pytest.mark.parametrize("name", _claiming(TOOL))
def test_scale_folding_keeps_the_model(name: str, model_dir) -> None:
    """Random per-channel scales folded into every group of every layer (the norm before q/k/v and
    gate/up, Gemma's as 1 + w, v_proj rows before o_proj, up_proj rows before down_proj) leave the
    transformers model's logits as they were: the tools' groups are the family's."""
    model = load_causal_lm(model_dir(name), torch.device("cpu"), torch.float32)
    ids = torch.tensor([TEXTS[0]])
    with torch.no_grad():
        before = model(ids).logits
    runner = LayerwiseRunner(model, ids)
    gen = torch.Generator().manual_seed(5)
    for layer in runner.layers:
        for group in scale_groups(layer, runner):
            width = next(iter(group.linears.values())).in_features
            apply_scale(group, 0.5 + 1.5 * torch.rand(width, generator=gen))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tool", [W8A8, W4A16])
@pytest.mark.parametrize("name", _refusing(TOOL))
def test_quantization_tool_refuses_the_family(name: str, tool: str, model_dir, tmp_path: Path) -> None:
    """Refused from config.json alone, naming the family's model type, before anything is loaded."""
    src = model_dir(name)
    model_type = json.loads((src / "config.json").read_text())["model_type"]
    with pytest.raises(QuantizationError, match=f"{FAMILIES[name].refused[TOOL]}.*'{model_type}'"):
        _quantize(tool, src, tmp_path / "out", None)
    assert not (tmp_path / "out").exists()
