"""`conveyor lite smooth_quant` on tiny random Llamas with outlier channels: smoothing, the int8
checkpoint in compressed-tensors' layout, the engine running it, the CLI's refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from calibration_models import logits, text, tiny_model, tokenizer, windows
from safetensors import safe_open

from conveyor.cli import main
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.quantization import (
    LayerwiseRunner,
    QuantizationError,
    SmoothQuantConfig,
    calibration_windows,
    smooth_quant,
    w8a8_quantization_config,
)
from conveyor.engine.quantization.scale_groups import recorded_inputs
from conveyor.engine.quantization.smooth_quant_tool import smooth_layer, smoothing_scales

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py

SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
          "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128),
          "mlp.down_proj": (128, 64)}  # (in, out) with GQA 4/2


def _smooth_all(model, ids: torch.Tensor, alpha: float = 0.5) -> list[dict[str, torch.Tensor]]:
    """Smooth every layer of ``model`` as the tool does; returns each layer's input ranges before smoothing."""
    runner = LayerwiseRunner(model, ids, batch_size=4)
    ranges = []
    for layer in runner.layers:
        outputs, records = runner.record(layer, recorded_inputs(layer))
        absmax = {k: r.absmax for k, r in records.items()}
        ranges.append(absmax)
        smooth_layer(layer, runner, absmax, alpha)
        runner.advance(outputs)
    return ranges


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha-smooths-o_proj", "gqa"])
def test_smoothing_keeps_the_unquantized_model_and_flattens_the_outliers(kv_heads: int):
    model = tiny_model(kv_heads)
    ids = windows(8, 32)
    before = logits(model, ids)
    ranges = _smooth_all(model, ids)
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4)
    # The norms' outlier channels (x12) dominate the q/k/v input; after smoothing the input's
    # channel ranges are far flatter.
    after = _smooth_all(model, ids)  # measures again on the smoothed model (and smooths a second time)
    for old, new in zip(ranges, after):
        x_old, x_new = old["self_attn.q_proj"], new["self_attn.q_proj"]
        assert (x_new.max() / x_new.median()) < 0.5 * (x_old.max() / x_old.median())


def test_smoothing_scales_follow_the_formula():
    x = torch.tensor([4.0, 1.0, 0.0, 9.0])
    lin = torch.nn.Linear(4, 2, bias=False)
    lin.weight.data = torch.tensor([[1.0, -4.0, 0.5, 0.25], [-0.5, 1.0, 2.0, 0.0]])
    s = smoothing_scales(x, [lin], alpha=0.5)
    expected = torch.tensor([2.0 / 1.0, 1.0 / 2.0, (1e-5) ** 0.5 / 2.0 ** 0.5, 3.0 / 0.5])
    torch.testing.assert_close(s, expected)
    assert torch.equal(smoothing_scales(x, [lin], alpha=1.0), x.clamp(min=1e-5))


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=64, block_size=8,
                                        max_batch_size=4, max_prefill_token_num=256))


def _held_out(n: int = 4) -> list[list[int]]:
    ids = tokenizer()(text(seed=11), add_special_tokens=False)["input_ids"]
    return calibration_windows(ids, n, 48).tolist()


def test_smooth_quant_writes_a_compressed_tensors_checkpoint_the_engine_runs(tiny_dir: Path, tmp_path: Path):
    out = tmp_path / "w8a8"
    result = smooth_quant(tiny_dir, out, SmoothQuantConfig(calib_samples=8, calib_seqlen=32), tmp_path / "calib.txt",
                          progress=False)
    assert result.calib_samples == 8 and len(result.max_scales) == 2 and "qkv" in result.max_scales[0]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == w8a8_quantization_config()
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").stat().st_mode & 0o044
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        t = {n: f.get_tensor(n) for n in f.keys()}
    for i in range(2):
        for proj, (inp, outp) in SHAPES.items():
            base = f"model.layers.{i}.{proj}"
            assert t[f"{base}.weight"].dtype == torch.int8 and t[f"{base}.weight"].shape == (outp, inp)
            assert t[f"{base}.weight"].abs().amax(1).eq(127).all()  # each row uses the full int8 range
            assert t[f"{base}.weight_scale"].dtype == torch.float32 and t[f"{base}.weight_scale"].shape == (outp, 1)
    assert t["model.layers.0.input_layernorm.weight"].dtype == torch.float16
    # The engine runs it, close to the unquantized model (int8 weights and activations on outliers).
    windows_ = _held_out()
    fp = _engine(tiny_dir).get_ppl(windows_)
    w8a8 = _engine(out).get_ppl(windows_)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(w8a8, fp)), (w8a8, fp)


def test_smoothing_makes_w8a8_closer_to_the_model(tiny_dir: Path, tmp_path: Path):
    calib = tmp_path / "calib.txt"
    errors = {}
    windows_ = _held_out(8)
    fp = _engine(tiny_dir).get_ppl(windows_)
    for smooth in (False, True):
        out = tmp_path / f"w8a8-{smooth}"
        smooth_quant(tiny_dir, out, SmoothQuantConfig(smooth=smooth, calib_samples=16, calib_seqlen=32),
                     calib if smooth else None, progress=False)
        errors[smooth] = sum(abs(a - b) for a, b in zip(_engine(out).get_ppl(windows_), fp))
    assert errors[True] < errors[False], errors


@pytest.mark.parametrize("flags, message", [
    (["--w-bits", "4"], "use --w-bits 8, or `conveyor lite auto_awq`"),
    (["--alpha", "1.5"], "--alpha 1.5 must be between 0 and 1"),
    (["--calib-seqlen", "0"], "calib-seqlen must be at least 1"),
    (["--calib-dataset", "missing.txt"], "not a file"),
    (["--dtype", "int8"], "invalid choice"),
    (["--calib-dataset", "x.txt", "--no-smooth"], "x.txt would be unused: --no-smooth"),
], ids=["bits4", "alpha", "seqlen0", "nodata", "dtype", "unused"])
def test_bad_flags_fail_before_any_work(tiny_dir: Path, tmp_path: Path, capsys, monkeypatch, flags, message):
    import conveyor.engine.quantization.tool_run as tool  # where both tools load the model

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded despite a bad setting")

    monkeypatch.setattr(tool, "load_causal_lm", no_load)
    out = tmp_path / "out"
    try:
        code = main(["lite", "smooth_quant", str(tiny_dir), "--work-dir", str(out), *flags])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    assert re.search(re.escape(message), capsys.readouterr().err)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_refuses_a_quantized_model_and_a_non_empty_work_dir(tiny_dir: Path, tmp_path: Path):
    out = tmp_path / "w8a8"
    smooth_quant(tiny_dir, out, SmoothQuantConfig(smooth=False), progress=False)
    with pytest.raises(QuantizationError, match="already quantized"):
        smooth_quant(out, tmp_path / "again", SmoothQuantConfig(smooth=False), progress=False)
    with pytest.raises(QuantizationError, match="not an empty directory"):
        smooth_quant(tiny_dir, out, SmoothQuantConfig(smooth=False), progress=False)
