"""engine/preflight.py: a model's path, config, weights' headers and tp split, checked before anything starts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_awq_engine import write_models as write_awq_models
from tiny_llama import random_tensors, write_checkpoint

from conveyor.engine.config import EngineConfig
from conveyor.engine.preflight import locate_model, looks_local, preflight
from conveyor.protocol import EngineConfigError, UnsupportedModelError

CPU = EngineConfig(device="cpu")


def dense_model(root: Path) -> Path:
    """The tiny Llama (4 heads, 2 kv heads, intermediate 96) as a dense safetensors directory."""
    common, linears = random_tensors(torch.Generator().manual_seed(0))
    return write_checkpoint(root / "dense", {**common, **{f"{k}.weight": w for k, w in linears.items()}})


def test_a_whole_checkpoint_passes_quickly_dense_and_awq(tmp_path: Path) -> None:
    awq, dense = write_awq_models(tmp_path)
    start = time.monotonic()
    assert preflight(dense, CPU) == dense and preflight(awq, CPU) == awq
    assert preflight(str(dense), EngineConfig(tp=2, device="cpu")) == dense  # 4 heads, 2 kv heads, 96 split
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("model", ["/no/such/model", "./no-such-model", "~/no-such-model-here", "../no-such"])
def test_a_local_looking_path_that_does_not_exist_is_an_error_not_a_hub_id(model: str) -> None:
    with pytest.raises(EngineConfigError, match="does not exist: give a Hugging Face model directory"):
        preflight(model, CPU)


def test_org_name_under_an_existing_folder_is_a_missing_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    assert looks_local("org/name") and not looks_local("other/name") and not looks_local("name")
    with pytest.raises(EngineConfigError, match="read as a local path because org/ exists here"):
        locate_model("org/name")


def test_a_hub_id_not_cached_without_network_says_so(tmp_path: Path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EngineConfigError) as info:
        preflight("someorg/not-cached-here", EngineConfig(device="cpu", download_dir=str(tmp_path)))
    message = str(info.value)
    assert "is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
    assert str(tmp_path) in message and "\n" not in message


def test_weights_cut_short_or_garbled_are_refused_by_their_header(tmp_path: Path) -> None:
    model = dense_model(tmp_path)
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-100])
    with pytest.raises(UnsupportedModelError, match="not a readable safetensors file .* download it again"):
        preflight(model, CPU)
    weights.write_bytes(b"\x00" * 3)
    with pytest.raises(UnsupportedModelError, match="damaged or cut short"):
        preflight(model, CPU)
    weights.write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="is empty"):
        preflight(model, CPU)


def test_a_tensor_the_config_needs_is_missing_or_misshapen(tmp_path: Path) -> None:
    model = dense_model(tmp_path)
    weights = model / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}, str(weights))
    with pytest.raises(UnsupportedModelError, match=r"missing parameters \(1\): model.layers.1.mlp.down_proj.weight"):
        preflight(model, CPU)
    save_file({**tensors, "model.norm.weight": torch.ones(65)}, str(weights))
    with pytest.raises(UnsupportedModelError, match=r"model.norm.weight has shape \(65,\)"):
        preflight(model, CPU)


def test_a_missing_shard_and_a_missing_config(tmp_path: Path) -> None:
    model = dense_model(tmp_path)
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(UnsupportedModelError, match="names model-00001-of-00002.safetensors and 1 more, which is "
                                                    "not there"):
        preflight(model, CPU)
    (model / "config.json").unlink()
    with pytest.raises(UnsupportedModelError, match="has no config.json"):
        preflight(model, CPU)


def test_tp_splits_are_checked_before_any_rank_starts(tmp_path: Path, monkeypatch) -> None:
    awq, dense = write_awq_models(tmp_path)
    with pytest.raises(EngineConfigError, match=r"num_attention_heads \(4\) does not split evenly over tp=3"):
        preflight(dense, EngineConfig(tp=3, device="cpu"))
    # 96 intermediate channels over 2 ranks are 48 a rank: not whole AWQ groups of 32
    with pytest.raises(EngineConfigError, match="down_proj's 96 inputs over tp=2 give 48 per rank"):
        preflight(awq, EngineConfig(tp=2, device="cpu"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(EngineConfigError, match="tp=2 needs 2 GPUs, one per rank; 1 visible"):
        preflight(dense, EngineConfig(tp=2, device="cuda"))


def test_dummy_weights_and_factory_engines_read_no_weights(tmp_path: Path) -> None:
    model = dense_model(tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="no weights found"):
        preflight(model, CPU)
    assert preflight(model, EngineConfig(device="cpu", load_format="dummy")) == model
    assert preflight(model, CPU, weights=False) == model


def test_pipeline_raises_the_typed_error_before_loading(tmp_path: Path) -> None:
    from conveyor import pipeline

    with pytest.raises(EngineConfigError, match="does not exist"):
        pipeline(str(tmp_path / "missing"))
    model = dense_model(tmp_path)
    (model / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(UnsupportedModelError, match="cut short"):
        pipeline(str(model), backend_config=CPU)


def test_tp_split_of_every_layer_is_checked_before_any_rank_starts(tmp_path: Path) -> None:
    """Splits only a layer knows (an expert's width here) are refused by preflight, by the name the
    layer gives, before a rank starts: the model is built on the meta device as rank 0 of tp."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=30)
    path = tmp_path / "moe"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}))
    with pytest.raises(EngineConfigError, match=r"moe_intermediate_size \(30\) does not split evenly over tp=4"):
        preflight(str(path), EngineConfig(tp=4, device="cpu", load_format="dummy"))
    assert preflight(str(path), EngineConfig(tp=2, device="cpu", load_format="dummy")) == path
