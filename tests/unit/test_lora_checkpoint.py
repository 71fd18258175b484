"""The PEFT LoRA reader (engine/lora/checkpoint.py) against peft itself: adapters made with peft on a
tiny random Llama (A and B seeded random; peft starts B at zero), and for every module the reader
lists, ``b @ a`` equals peft's delta (``merge_and_unload``'s weight minus the base's), with no other
module listed; then every checkpoint the engine cannot apply is refused with a message naming the
fix."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine.lora.checkpoint import PeftLoRA, read_peft_lora
from conveyor.protocol.errors import AdapterError

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base():
    """A tiny random transformers Llama (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def make(base, path: Path, seed: int = 1, safe: bool = True, **lora) -> Path:
    """A peft LoRA adapter on a copy of ``base``, every lora_A / lora_B seeded random, saved at ``path``."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=safe)
    return path


def peft_deltas(base, path: Path) -> dict[str, torch.Tensor]:
    """{module name: merged weight - base weight} for every module peft puts a LoRA layer on when it
    loads ``path``."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), path)
    names = [n.removeprefix("base_model.model.") for n, m in model.named_modules() if "default" in
             getattr(m, "lora_A", {})]
    merged = dict(model.merge_and_unload().named_modules())
    original = dict(base.named_modules())
    return {n: merged[n].weight.detach() - original[n].weight.detach() for n in names}


def check_against_peft(base, path: Path) -> PeftLoRA:
    lora = read_peft_lora(path)
    want = peft_deltas(base, path)
    assert sorted(lora.modules) == sorted(want)
    for name, delta in want.items():
        module = lora.modules[name]
        assert module.a.dtype == module.b.dtype == torch.float32
        assert module.a.shape[1] == delta.shape[1] and module.b.shape[0] == delta.shape[0]
        torch.testing.assert_close(module.b @ module.a, delta, rtol=1e-5, atol=1e-6, msg=name)
    return lora


CASES = {
    "all7_r4": dict(r=4, lora_alpha=8, target_modules=list(ALL)),
    "qv_r8_rslora": dict(r=8, lora_alpha=3, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp_r16_bin": dict(r=16, lora_alpha=40, target_modules=list(MLP), safe=False),
    # peft's pattern rules: a key is a regex matched at the name's end on a dot boundary ("self_attn"
    # and "proj" match nothing here), and the first key in the config's order wins.
    "patterns": dict(r=8, lora_alpha=16, target_modules=list(ALL),
                     rank_pattern={r"layers\.1\.(self_attn\.q|mlp\.down)_proj": 16, "q_proj": 4},
                     alpha_pattern={"self_attn": 100, "proj": 50, "v_proj": 5, "model.layers.0.self_attn.o_proj": 2}),
    "patterns_rslora": dict(r=4, lora_alpha=6, target_modules=["k_proj", "up_proj"], use_rslora=True,
                            rank_pattern={"up_proj": 16}, alpha_pattern={"k_proj": 1}),
    "layers_to_transform": dict(r=4, lora_alpha=4, target_modules=["q_proj", "down_proj"], layers_to_transform=[1]),
    "regex_targets": dict(r=8, lora_alpha=16, target_modules=r".*\.layers\.0\..*(k_proj|gate_proj)"),
    "exclude": dict(r=4, lora_alpha=8, target_modules=list(ALL), exclude_modules=["up_proj"]),
}
EXPECTED_TARGETS = {"all7_r4": ALL, "qv_r8_rslora": ("q_proj", "v_proj"), "mlp_r16_bin": MLP, "patterns": ALL,
                    "patterns_rslora": ("k_proj", "up_proj"), "layers_to_transform": ("q_proj", "down_proj"),
                    "regex_targets": ("k_proj", "gate_proj"),
                    "exclude": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")}


@pytest.mark.parametrize("case", CASES)
def test_equals_peft_merge(base, tmp_path, case):
    lora_kw = dict(CASES[case])
    safe = lora_kw.pop("safe", True)
    path = make(base, tmp_path / case, safe=safe, **lora_kw)
    assert (path / ("adapter_model.safetensors" if safe else "adapter_model.bin")).is_file()
    lora = check_against_peft(base, path)
    assert lora.target_modules == EXPECTED_TARGETS[case]
    assert lora.rank == max(m.a.shape[0] for m in lora.modules.values())
    assert lora.path == path
    if case == "patterns":
        assert lora.rank == 16
        assert lora.modules["model.layers.0.self_attn.q_proj"].a.shape[0] == 4
        assert lora.modules["model.layers.1.self_attn.q_proj"].a.shape[0] == 16
        assert lora.modules["model.layers.1.mlp.down_proj"].a.shape[0] == 16
        assert lora.modules["model.layers.0.mlp.down_proj"].a.shape[0] == 8
    if case == "layers_to_transform":
        assert all(".layers.1." in m for m in lora.modules)


@pytest.fixture(scope="module")
def good(base, tmp_path_factory) -> Path:
    """One valid adapter (q, v, down; r 4), copied by the refusal tests and edited."""
    return make(base, tmp_path_factory.mktemp("lora") / "good", r=4, lora_alpha=8,
                target_modules=["q_proj", "v_proj", "down_proj"])


def edited(good: Path, tmp_path: Path, config: dict | None = None, drop: tuple[str, ...] = (),
           tensors=None) -> Path:
    """A copy of ``good`` with config fields replaced, config fields dropped, and the tensors
    rewritten by ``tensors(dict)``."""
    path = tmp_path / "edited"
    shutil.copytree(good, path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(config or {})
    for name in drop:
        cfg.pop(name)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        weights = load_file(str(path / "adapter_model.safetensors"))
        tensors(weights)
        save_file(weights, str(path / "adapter_model.safetensors"))
    return path


def test_adapter_name_in_keys_and_config_extras(base, good, tmp_path):
    # Older saves keep the adapter's name (lora_A.default.weight); fan_in_fan_out describes the
    # base weight's layout, not the pair's (peft turns it off on nn.Linear bases itself).
    def rename(weights):
        for key in list(weights):
            weights[key.replace(".weight", ".default.weight")] = weights.pop(key)

    path = edited(good, tmp_path, {"fan_in_fan_out": True, "init_lora_weights": "gaussian"}, tensors=rename)
    assert all(".default.weight" in k for k in load_file(str(path / "adapter_model.safetensors")))
    want = read_peft_lora(good)
    got = read_peft_lora(path)
    assert sorted(got.modules) == sorted(want.modules) and len(got.modules) == 6
    for name, module in want.modules.items():
        assert torch.equal(got.modules[name].a, module.a) and torch.equal(got.modules[name].b, module.b)
    assert got.base_model_name_or_path == want.base_model_name_or_path
    check_against_peft(base, path)


def test_hub_id_downloaded(good, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(good)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    lora = read_peft_lora("someorg/some-adapter", download_dir="/tmp/hub-cache")
    assert lora.path == good and len(lora.modules) == 6
    assert calls == [("someorg/some-adapter", {"cache_dir": "/tmp/hub-cache", "allow_patterns": [
        "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]})]


def test_hub_id_not_downloaded(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(AdapterError, match="could not be downloaded.*pass a local directory"):
        read_peft_lora("someorg/no-such-adapter")


def test_not_a_directory(good, tmp_path):
    with pytest.raises(AdapterError, match="no such directory.*adapter_config.json and adapter_model.safetensors"):
        read_peft_lora(tmp_path / "missing")
    with pytest.raises(AdapterError, match="is a file; pass the directory"):
        read_peft_lora(good / "adapter_config.json")


def test_missing_files(good, tmp_path):
    path = shutil.copytree(good, tmp_path / "a")
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_peft_lora(path)
    path = shutil.copytree(good, tmp_path / "b")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no weights file; expected adapter_model.safetensors or adapter_model.bin"):
        read_peft_lora(path)
    (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="adapter_model.safetensors could not be read"):
        read_peft_lora(path)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json is not valid JSON"):
        read_peft_lora(path)


@pytest.mark.parametrize(("config", "drop", "message"), [
    ({"peft_type": "IA3"}, (), "peft_type 'IA3'; only LoRA adapters"),
    ({}, ("peft_type",), "peft_type None; only LoRA adapters"),
    ({"use_dora": True}, (), "DoRA"),
    ({"bias": "lora_only"}, (), "bias='lora_only'.*train with bias='none'"),
    ({"lora_bias": True}, (), "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, (), "modules_to_save.*no longer shares the base model.*merge_and_unload"),
    ({"trainable_token_indices": [1, 2]}, (), "trainable_token_indices"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, (), "target_parameters"),
    ({"layer_replication": [[0, 2], [1, 2]]}, (), "layer_replication"),
    ({"use_qalora": True}, (), "use_qalora"),
    ({"alora_invocation_tokens": [5, 6]}, (), "activated LoRA"),
    ({"arrow_config": {"top_k": 2}}, (), "arrow_config"),
    ({"init_lora_weights": "pissa_niter_4"}, (), "changes the base weights.*path_initial_model_for_weight_conversion"),
    ({"init_lora_weights": "olora"}, (), "changes the base weights"),
    ({"init_lora_weights": "loftq"}, (), "changes the base weights"),
    ({"r": 0}, (), "needs r, a positive integer"),
    ({"lora_alpha": "16"}, (), "needs lora_alpha, a number"),
    ({"rank_pattern": {"q_proj": 0}}, (), "rank_pattern must map"),
    ({"alpha_pattern": {"(q_proj": 2}}, (), "alpha_pattern '\\(q_proj' is not a valid regular expression"),
    ({"r": 8}, (), "has rank 4 but adapter_config.json says r=8"),
    ({"rank_pattern": {"v_proj": 2}}, (), "v_proj has rank 4 but adapter_config.json says r=2"),
    ({"layers_to_transform": [0]}, (), "layers.1.*which adapter_config.json does not select.*peft would drop"),
    ({"target_modules": ["q_proj", "v_proj"]}, (), "down_proj, which adapter_config.json does not select"),
    ({"exclude_modules": "model\\.layers\\.0\\.mlp\\.down_proj"}, (), "layers.0.mlp.down_proj, which"),
])
def test_config_refused(good, tmp_path, config, drop, message):
    path = edited(good, tmp_path, config, drop)
    with pytest.raises(AdapterError, match=message) as info:
        read_peft_lora(path)
    assert str(path) in str(info.value)


def _first(weights: dict, kind: str) -> str:
    return next(k for k in sorted(weights) if kind in k)


@pytest.mark.parametrize(("change", "message"), [
    (lambda w: w.pop(_first(w, "lora_B")), "has lora_A but no lora_B.*save the adapter again"),
    (lambda w: w.pop(_first(w, "lora_A")), "has lora_B but no lora_A"),
    (lambda w: w.update({_first(w, "lora_B"): torch.zeros(64, 3)}), r"do not make a low-rank pair \(lora_A \[r, in\]"),
    (lambda w: w.update({_first(w, "lora_A"): torch.zeros(4, 64, 1)}), "do not make a low-rank pair"),
    (lambda w: w[_first(w, "lora_A")].__setitem__((0, 3), float("nan")), "not all finite"),
    (lambda w: w[_first(w, "lora_B")].__setitem__((5, 1), float("inf")), "not all finite"),
    (lambda w: w.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight": torch.zeros(4, 64)}),
     "more than one adapter"),
    (lambda w: w.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}),
     "DoRA"),
    (lambda w: w.update({"base_model.model.lm_head.weight": torch.zeros(128, 64)}), "unexpected tensor.*lm_head"),
    (lambda w: w.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)}),
     "unexpected tensor"),
    (lambda w: w.clear() or w.update({"other": torch.zeros(1)}), "unexpected tensor other"),
    (lambda w: w.clear(), "its weights file holds no lora_A / lora_B tensors"),
])
def test_weights_refused(good, tmp_path, change, message):
    with pytest.raises(AdapterError, match=message):
        read_peft_lora(edited(good, tmp_path, tensors=change))


@pytest.mark.parametrize(("lora", "message"), [
    (dict(target_modules=["q_proj", "embed_tokens"]), "lora_embedding_A.*embedding adapters are not served"),
    (dict(target_modules=["q_proj", "lm_head"]), "it adapts lm_head; the engine applies adapters to q_proj, k_proj, "
                                                 "v_proj, o_proj, gate_proj, up_proj, down_proj only"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj"], use_dora=True), "DoRA"),
])
def test_peft_made_refused(base, tmp_path, lora, message):
    # Adapters peft really makes, not hand-edited ones: their tensors are what a user would bring.
    path = make(base, tmp_path / "bad", r=4, lora_alpha=8, **lora)
    with pytest.raises(AdapterError, match=message):
        read_peft_lora(path)
