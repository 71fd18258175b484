"""`conveyor lite auto_awq` end to end on SmolLM2-135M: the AutoAWQ "gemm" checkpoint it writes,
and that checkpoint loaded by ``pipeline``, ``conveyor serve api_server`` and ``conveyor chat``.

Few, short calibration windows keep it to about a minute on two CPU cores; the quality of a
full-size run is measured by ``python -m benchmarks.quant_quality``. Select with ``-m slow``
or by this file's path.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from conveyor.cli import main
from conveyor.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

GROUP = 64  # 128 does not divide SmolLM2's hidden size of 576
HIDDEN, INTER, KV = 576, 1536, 192
LAYERS = 30
# (in, out) of every quantized linear.
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
          "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER),
          "mlp.down_proj": (INTER, HIDDEN)}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER_TOKENS = 8  # a handful: the served and the terminal answers only have to match the pipeline's


@pytest.fixture(scope="module")
def awq_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("awq") / "SmolLM2-135M-Instruct-awq"
    code = main(["lite", "auto_awq", str(smollm2_dir), "--work-dir", str(out), "--w-group-size", str(GROUP),
                 "--calib-samples", "8", "--calib-seqlen", "128", "--log-level", "WARNING"])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def awq_greedy(awq_dir: Path):
    """The in-process pipeline's greedy answer to MESSAGES: what the server and `conveyor chat` must say."""
    from conveyor import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(session_len=512, cache_max_entry_count=64, block_size=16)
    with pipeline(str(awq_dir), backend_config=config) as pipe:
        return pipe(MESSAGES, GenerationConfig(max_new_tokens=ANSWER_TOKENS, top_k=1))


@pytest.fixture(scope="module")
def awq_server(awq_dir: Path, tmp_path_factory):
    srv = ServerProcess(awq_dir, "--cache-max-entry-count", "64", "--cache-block-seq-len", "16",
                        "--session-len", "512", log_dir=tmp_path_factory.mktemp("awq-server"))
    yield srv
    assert srv.terminate() == 0, srv.log()


def test_lmdeploys_group_size_is_refused_naming_the_fix(smollm2_dir: Path, tmp_path: Path, capsys):
    # 128 does not divide SmolLM2's 576: the default is 64 there (test_awq_tool), an explicit 128 is refused.
    assert main(["lite", "auto_awq", str(smollm2_dir), "--work-dir", str(tmp_path / "out"),
                 "--w-group-size", "128"]) == 2
    assert "use --w-group-size 64 or 32" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_checkpoint_has_autoawq_gemm_tensors(awq_dir: Path):
    with safe_open(str(awq_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for i in range(LAYERS):
            for proj, (k, n) in SHAPES.items():
                base = f"model.layers.{i}.{proj}"
                assert f"{base}.weight" not in names
                qweight, qzeros, scales = (f.get_tensor(f"{base}.{leaf}") for leaf in ("qweight", "qzeros", "scales"))
                assert qweight.dtype == torch.int32 and qweight.shape == (k, n // 8)
                assert qzeros.dtype == torch.int32 and qzeros.shape == (k // GROUP, n // 8)
                assert scales.dtype == torch.float16 and scales.shape == (k // GROUP, n)
                assert torch.isfinite(scales).all() and (scales > 0).all()
        for name in ("model.embed_tokens.weight", "model.norm.weight",
                     f"model.layers.{LAYERS - 1}.input_layernorm.weight"):
            assert f.get_tensor(name).dtype == torch.float16
        assert "lm_head.weight" not in names  # tied to the embedding, as in the original
    assert len(names) == LAYERS * (7 * 3 + 2) + 2


def test_config_and_tokenizer_files(awq_dir: Path, smollm2_dir: Path):
    config = json.loads((awq_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                             "zero_point": True, "version": "gemm"}
    original = json.loads((smollm2_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("quantization_config", "dtype", "torch_dtype")} == {
        k: v for k, v in original.items() if k not in ("dtype", "torch_dtype")}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (awq_dir / name).read_bytes() == (smollm2_dir / name).read_bytes()


def test_engine_runs_the_checkpoint_as_its_dequantized_copy(awq_dir: Path, tmp_path: Path):
    """The engine reads the packed weights as the tool meant them: same loss as the dequantized copy."""
    from conveyor import EngineConfig, pipeline
    from conveyor.engine.quantization import dequantize_checkpoint

    deq = dequantize_checkpoint(awq_dir, tmp_path / "deq")
    text = ("It was on a dreary night of November that I beheld the accomplishment of my toils. With an anxiety "
            "that almost amounted to agony, I collected the instruments of life around me.")
    losses = []
    for path in (awq_dir, deq):
        with pipeline(str(path), backend_config=EngineConfig(session_len=256, cache_max_entry_count=8)) as pipe:
            losses.append(pipe.get_ppl(pipe.tokenizer.encode(text))[0])
    assert math.isfinite(losses[0]) and math.exp(losses[0]) < 200
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_api_server_serves_the_checkpoint_as_the_pipeline_does(awq_server: ServerProcess, awq_dir: Path, awq_greedy):
    # Nothing the server says names the weight format (no ModelCard field, no log line), so what
    # shows that it runs the AWQ weights is that it answers as the pipeline on them does.
    models = httpx.get(f"{awq_server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [awq_dir.name]
    body = httpx.post(f"{awq_server.url}/v1/chat/completions", timeout=120, json={
        "model": awq_dir.name, "messages": MESSAGES, "temperature": 0, "max_tokens": ANSWER_TOKENS}).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == awq_greedy.text, awq_server.log()
    assert choice["finish_reason"] == awq_greedy.finish_reason
    assert body["usage"]["prompt_tokens"] == awq_greedy.input_token_len
    assert body["usage"]["completion_tokens"] == awq_greedy.generate_token_len


def test_terminal_chat_answers_a_piped_prompt(awq_dir: Path, awq_greedy):
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli", "chat", str(awq_dir), "--max-new-tokens", str(ANSWER_TOKENS),
         "--top-k", "1", "--session-len", "512", "--cache-max-entry-count", "0.01"],
        input=MESSAGES[0]["content"] + "\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr
    assert done.stdout.strip() == awq_greedy.text.strip()  # top_k=1: the pipeline's greedy answer
