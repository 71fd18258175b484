"""`conveyor lite smooth_quant` end to end on SmolLM2-135M: the W8A8 checkpoint it writes, run by the engine.

Few, short calibration windows keep it quick on two CPU cores; the quality of a full-size run is
measured by ``python -m benchmarks.quant_quality``. Select with ``-m slow`` or by this file's path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conveyor import EngineConfig, GenerationConfig, pipeline
from conveyor.cli import main

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "time_machine.txt"  # never calibrated on


@pytest.fixture(scope="module")
def w8a8_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w8a8") / "SmolLM2-135M-Instruct-w8a8"
    code = main(["lite", "smooth_quant", str(smollm2_dir), "--work-dir", str(out), "--calib-samples", "8",
                 "--calib-seqlen", "128", "--log-level", "WARNING"])
    assert code == 0
    return out


def test_checkpoint_is_compressed_tensors_int8(w8a8_dir: Path):
    config = json.loads((w8a8_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(str(w8a8_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
        assert f.get_tensor("model.layers.29.mlp.down_proj.weight_scale").shape == (576, 1)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    assert (w8a8_dir / "chat_template.jinja").exists() or "chat_template" in (
        w8a8_dir / "tokenizer_config.json").read_text()


def _ppl_windows(tokenizer_dir: Path, n: int = 3, size: int = 256) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir))(TEXT.read_text()[:20000], add_special_tokens=False)
    ids = ids["input_ids"]
    return [ids[i * size:(i + 1) * size] for i in range(n)]


def test_w8a8_perplexity_is_close_to_fp32_and_chat_works(w8a8_dir: Path, smollm2_dir: Path):
    windows = _ppl_windows(smollm2_dir)
    config = EngineConfig(device="cpu", session_len=1024, cache_max_entry_count=32)
    with pipeline(str(smollm2_dir), backend_config=config) as pipe:
        fp32 = pipe.get_ppl(windows)
    with pipeline(str(w8a8_dir), backend_config=config) as pipe:
        w8a8 = pipe.get_ppl(windows)
        answer = pipe([[{"role": "user", "content": "What is the capital of France?"}]],
                      gen_config=GenerationConfig(max_new_tokens=16, top_k=1))[0]
    # mean token losses: int8 weights and activations move them by a few percent at most
    for a, b in zip(w8a8, fp32):
        assert abs(a - b) < 0.05 * b, (w8a8, fp32)
    assert "Paris" in answer.text
