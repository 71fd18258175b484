"""EngineConfig: LMDeploy's fields either work, are refused with the fix, or warn once."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from conveyor.engine import weight_loader
from conveyor.engine.config import EngineConfig, PytorchEngineConfig, TurbomindEngineConfig
from conveyor.errors import EngineConfigError

LOGGER = "conveyor.engine.config"


@pytest.fixture
def warnings_(caplog: pytest.LogCaptureFixture):
    """The config module's WARNING records, captured whatever level other tests left."""
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]

    return records


# ---- defaults ------------------------------------------------------------------------------

def test_lmdeploy_names_are_the_same_class():
    assert TurbomindEngineConfig is EngineConfig and PytorchEngineConfig is EngineConfig


def test_defaults_are_lmdeploys():
    cfg = EngineConfig()
    assert (cfg.model_name, cfg.download_dir, cfg.revision, cfg.use_logn_attn) == (None, None, None, False)
    assert (cfg.num_tokens_per_iter, cfg.max_prefill_iters, cfg.max_prefill_token_num) == (0, 1, 8192)
    assert (cfg.eviction_type, cfg.prefill_interval, cfg.num_cpu_blocks) == ("recompute", 16, 0)
    assert (cfg.adapters, cfg.thread_safe, cfg.shared_cache, cfg.model_format) == (None, False, False, None)


def test_extra_field_is_gone():
    assert "extra" not in {f.name for f in dataclasses.fields(EngineConfig)}
    with pytest.raises(TypeError):
        EngineConfig(extra={})  # type: ignore[call-arg]


@pytest.mark.parametrize("kwargs", [
    {},
    # every LMDeploy field spelled out at its default (both backends' spellings of "no name")
    dict(model_name=None, download_dir=None, revision=None, use_logn_attn=False, num_tokens_per_iter=0,
         max_prefill_iters=1, eviction_type="recompute", prefill_interval=16, num_cpu_blocks=0,
         adapters=None, thread_safe=False, shared_cache=False, model_format=None),
    dict(model_name="", adapters={}, model_format="hf"),
])
def test_defaults_are_silent(warnings_, kwargs):
    EngineConfig(**kwargs)
    assert warnings_() == []


# ---- refused, with the fix in the message ---------------------------------------------------

@pytest.mark.parametrize(("kwargs", "fix"), [
    (dict(eviction_type="copy"), "eviction_type='recompute'"),
    (dict(eviction_type="swap"), "'recompute'"),
    (dict(adapters=["org/lora"]), "dict of adapter name -> PEFT checkpoint directory"),
    (dict(adapters={"": "org/lora"}), "dict of adapter name"),
    (dict(max_loras=0), "max_loras=0: give a whole number >= 1"),
    (dict(max_lora_rank=True), "max_lora_rank=True"),
    (dict(use_logn_attn=True), "use_logn_attn=False"),
    (dict(num_cpu_blocks=128), "num_cpu_blocks=0"),
    (dict(num_cpu_blocks=128), "recomputed"),
    (dict(num_cpu_blocks=-1), "must be 0"),
    (dict(shared_cache=True), "shared_cache=False"),
    (dict(model_format="llama"), "convert_llama_weights_to_hf"),
    (dict(model_format="exl2"), "use None or 'hf'"),
    (dict(max_prefill_iters=0), "must be >= 1"),
    (dict(prefill_interval=0), "must be >= 1"),
    (dict(num_tokens_per_iter=-1), "must be >= 0"),
    (dict(num_tokens_per_iter=2048, max_prefill_token_num=1024), "set only one"),
    (dict(revision=""), "branch, tag or commit"),
    (dict(revision=3), "use a string"),
    (dict(download_dir=""), "name a directory"),
    (dict(session_idle_timeout=-1), "must be >= 0 seconds"),
    (dict(session_idle_timeout=-0.5), "0 or None keeps"),
    (dict(session_idle_timeout="10m"), "give seconds as a number"),
    (dict(session_idle_timeout=True), "give seconds as a number"),
    (dict(session_idle_timeout=float("nan")), "give seconds as a number"),
])
def test_unimplemented_values_are_refused_with_the_fix(warnings_, kwargs, fix):
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(**kwargs)
    assert fix in str(info.value)
    assert str(next(iter(kwargs))) in str(info.value)  # the message names the option
    assert warnings_() == []


@pytest.mark.parametrize("timeout", [None, 0, 0.0, 1, 600.0])
def test_session_idle_timeout_accepts_seconds_or_none(warnings_, timeout):
    assert EngineConfig(session_idle_timeout=timeout).session_idle_timeout == timeout
    assert warnings_() == []


def test_session_idle_timeout_defaults_to_ten_minutes():
    assert EngineConfig().session_idle_timeout == 600.0


def test_refusal_is_a_value_error():
    with pytest.raises(ValueError):
        PytorchEngineConfig(eviction_type="copy")


# ---- no effect: exactly one warning ---------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "why"), [
    (dict(model_name="internlm2"), "ChatTemplateConfig"),
    (dict(max_prefill_iters=4), "max_prefill_token_num"),
    (dict(prefill_interval=8), "every step"),
    (dict(thread_safe=True), "several threads"),
    (dict(model_format="gguf"), ".gguf"),
])
def test_no_effect_values_warn_once(warnings_, kwargs, why):
    EngineConfig(**kwargs)
    [record] = warnings_()
    message = record.getMessage()
    name = next(iter(kwargs))
    assert name in message and "has no effect" in message and why in message
    if name in ("model_name", "max_prefill_iters", "prefill_interval"):
        assert record.args  # lazy %-formatting, not a pre-built string


def test_each_no_effect_option_warns_once_when_combined(warnings_):
    EngineConfig(model_name="x", max_prefill_iters=2, prefill_interval=4, thread_safe=True, model_format="gguf")
    names = sorted(r.getMessage().split("=")[0] for r in warnings_())
    assert names == sorted(f"EngineConfig.{n}" for n in
                           ("model_name", "max_prefill_iters", "prefill_interval", "thread_safe", "model_format"))


def test_a_refused_config_does_not_also_warn(warnings_):
    with pytest.raises(EngineConfigError):
        EngineConfig(model_name="x", shared_cache=True)
    assert warnings_() == []


# ---- mapped onto working fields -------------------------------------------------------------

def test_num_tokens_per_iter_sets_the_step_token_budget(warnings_):
    assert TurbomindEngineConfig(num_tokens_per_iter=2048).max_prefill_token_num == 2048
    assert EngineConfig(num_tokens_per_iter=512, max_prefill_token_num=512).max_prefill_token_num == 512
    assert EngineConfig(num_tokens_per_iter=0, max_prefill_token_num=1024).max_prefill_token_num == 1024
    assert warnings_() == []


def test_mapping_survives_dataclasses_replace(warnings_):
    cfg = dataclasses.replace(EngineConfig(num_tokens_per_iter=1024), max_batch_size=8)
    assert (cfg.max_prefill_token_num, cfg.max_batch_size) == (1024, 8)
    assert warnings_() == []


def test_other_lmdeploy_spellings_still_map():
    cfg = PytorchEngineConfig(num_gpu_blocks=300, cache_block_seq_len=32)
    assert (cfg.cache_max_entry_count, cfg.block_size) == (300, 32)


# ---- revision / download_dir reach the hub download -----------------------------------------

@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Replace huggingface_hub.snapshot_download (no network here); records each call's kwargs."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls: list[dict] = []
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()

    def snapshot_download(repo_id, **kwargs):
        calls.append(dict(repo_id=repo_id, **kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls, snapshot


def test_revision_and_download_dir_are_passed_to_the_hub(fake_hub, tmp_path):
    calls, snapshot = fake_hub
    (snapshot / "model.safetensors").write_bytes(b"")
    cfg = EngineConfig(revision="v1.0", download_dir=str(tmp_path / "hub"))
    path = weight_loader.resolve_model_path("org/model", cfg.revision, download_dir=cfg.download_dir)
    assert path == snapshot
    [call] = calls
    assert call["repo_id"] == "org/model"
    assert call["revision"] == "v1.0" and call["cache_dir"] == str(tmp_path / "hub")


def test_bin_fallback_download_keeps_revision_and_download_dir(fake_hub, tmp_path):
    calls, _ = fake_hub  # the snapshot has no *.safetensors: a second download fetches *.bin
    weight_loader.resolve_model_path("org/model", "abc123", download_dir="~/hub")
    assert len(calls) == 2
    expected = str(Path("~/hub").expanduser())
    assert all(c["revision"] == "abc123" and c["cache_dir"] == expected for c in calls)
    assert "*.bin" in calls[1]["allow_patterns"]


def test_defaults_leave_the_hub_cache_alone(fake_hub):
    calls, snapshot = fake_hub
    (snapshot / "model.safetensors").write_bytes(b"")
    weight_loader.resolve_model_path("org/model")
    assert calls[0]["revision"] is None and calls[0]["cache_dir"] is None


def test_local_paths_are_used_as_they_are(fake_hub, tmp_path):
    calls, _ = fake_hub
    assert weight_loader.resolve_model_path(tmp_path, "v1.0", download_dir=str(tmp_path / "hub")) == tmp_path
    assert calls == []


def test_quant_policy_values() -> None:
    """LMDeploy's KV cache policies are accepted; anything else names the three that exist."""
    from conveyor.kernels.kv_layout import QUANT_POLICIES

    for policy in QUANT_POLICIES:
        assert EngineConfig(quant_policy=policy).quant_policy == policy
    with pytest.raises(EngineConfigError, match=r"use 0 \(none\), 4 \(int4 KV\) or 8 \(int8 KV\)"):
        EngineConfig(quant_policy=2)


# ---- how the steps run: settings that were environment variables -----------------------------------

def test_execution_defaults():
    cfg = EngineConfig()
    assert (cfg.eager_mode, cfg.kernels, cfg.tp_all_reduce, cfg.tp_hang_timeout, cfg.rank_timing_dir) == \
        (False, "auto", "nccl", 30.0, None)


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"eager_mode": "yes"}, "eager_mode='yes': use True"),
    ({"kernels": "cuda"}, "kernels='cuda': use 'auto'"),
    ({"tp_all_reduce": "ring"}, "tp_all_reduce='ring' is not one of nccl, one_shot, two_shot, fused"),
    ({"tp_hang_timeout": 0}, "tp_hang_timeout=0: give the seconds"),
    ({"tp_hang_timeout": -1.0}, "number > 0"),
    ({"tp_hang_timeout": float("nan")}, "number > 0"),
    ({"tp_hang_timeout": "30"}, "number > 0"),
    ({"rank_timing_dir": ""}, "rank_timing_dir='': name a directory"),
])
def test_execution_settings_are_refused_with_the_fix(warnings_, kwargs, fix):
    with pytest.raises(EngineConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kwargs)
    assert not warnings_()


@pytest.mark.parametrize("kwargs", [{"eager_mode": True}, {"kernels": "ref"}, {"kernels": "triton"},
                                    {"tp_all_reduce": "one_shot"}, {"tp_all_reduce": "two_shot"},
                                    {"tp_hang_timeout": 2}, {"rank_timing_dir": "/tmp/timing"}])
def test_execution_settings_are_taken(warnings_, kwargs):
    cfg = EngineConfig(**kwargs)
    assert all(getattr(cfg, k) == v for k, v in kwargs.items()) and not warnings_()


def test_the_kernel_modes_are_the_kernels_own():
    """engine/config.py stays torch-free, so it names the modes kernels/_triton.py dispatches on."""
    from conveyor.engine.config import KERNEL_MODES
    from conveyor.kernels import KERNEL_MODES as dispatched

    assert KERNEL_MODES == dispatched


def test_the_engine_applies_its_kernel_mode(tmp_path):
    """The mode is the process's: an engine sets it once, from its config."""
    import torch

    from conveyor.kernels import kernel_mode
    from tiny_llama import engine, random_tensors, write_checkpoint

    common, linears = random_tensors(torch.Generator().manual_seed(0))
    path = write_checkpoint(tmp_path / "m", {**common, **{f"{k}.weight": w for k, w in linears.items()}})
    eng = engine(path, kernels="ref")
    try:
        assert kernel_mode() == "ref"
    finally:
        eng.close()
