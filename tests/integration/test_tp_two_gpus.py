"""Tensor parallel on two GPUs (NCCL): a tp=2 pipeline script and a tp=2 server exit within
seconds, also after a rank dies. Random weights of a Llama-2-7B shape cut to 4 layers, with the
test model's tokenizer; skipped below two GPUs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from conveyor.engine.dummy_model import SHAPES
from conveyor.testing.server_process import ServerProcess, pid_alive
from conveyor.testing.waiting import wait_until

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

# The device notes: NVLink multicast stays off, also in every process these tests start.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_SCRIPT = """
import faulthandler, os, signal, sys, time
from conveyor import GenerationConfig, PytorchEngineConfig, pipeline

faulthandler.dump_traceback_later(100, exit=True)  # a hang fails with every thread's stack

pipe = pipeline({model!r}, backend_config=PytorchEngineConfig(tp=2, load_format="dummy", dtype="bfloat16",
                                                               cache_max_entry_count=0.1))
out = pipe(["hello", "tell me a story"], gen_config=GenerationConfig(max_new_tokens=8, ignore_eos=True))
print("TOKENS", [len(o.token_ids) for o in out], flush=True)
if {kill_rank!r}:
    os.kill(pipe.engine.tp_workers.procs[0].pid, signal.SIGKILL)
    try:
        pipe(["again"], gen_config=GenerationConfig(max_new_tokens=8))
        print("NO ERROR", flush=True)
    except Exception as exc:
        print("ERROR", type(exc).__name__, flush=True)
        print("RAISED", time.monotonic(), repr(exc)[:300], flush=True)
if {close!r}:
    pipe.close()
print("LAST", time.monotonic(), flush=True)
"""


@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A Llama-2-7B shape cut to 4 layers (random weights at load), with the test model's tokenizer."""
    dest = tmp_path_factory.mktemp("tp2") / "llama2-7b-4l"
    dest.mkdir()
    config = {**SHAPES["llama2-7b"], "num_hidden_layers": 4, "vocab_size": 49152}
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smollm2_dir) / name).is_file():
            shutil.copyfile(Path(smollm2_dir) / name, dest / name)
    return dest


@pytest.mark.parametrize("close, kill_rank", [(True, False), (False, False), (True, True)],
                         ids=["closed", "left-open", "rank-killed"])
def test_a_tp2_pipeline_script_exits_within_seconds_of_its_last_result(model_dir, tmp_path, close, kill_rank) -> None:
    script = tmp_path / "script.py"  # module level, no main guard: as users write them
    script.write_text(_SCRIPT.format(model=str(model_dir), close=close, kill_rank=kill_rank))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200,
                          env={**os.environ, **MULTICAST_OFF})
    ended = time.monotonic()
    said = proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, said
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["TOKENS"] == "[8, 8]"
    if kill_rank:
        # the pipeline's engine stage died of it: the pipeline's error names the rank
        assert lines.get("ERROR") == "EngineDiedError" and "rank 1" in lines["RAISED"], said
    assert ended - float(lines["LAST"]) < 20, f"exited {ended - float(lines['LAST']):.1f}s after its last line: {said}"


def _complete(server: ServerProcess) -> httpx.Response:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True})


def _tp2_server(model_dir: Path, tmp_path: Path) -> ServerProcess:
    return ServerProcess(model_dir, "--tp", "2", "--dummy-weights", str(model_dir / "config.json"),
                         log_dir=tmp_path, env=MULTICAST_OFF)


def test_sigterm_stops_every_rank_of_a_tp2_server_within_seconds(model_dir, tmp_path) -> None:
    server = _tp2_server(model_dir, tmp_path)
    try:
        assert _complete(server).status_code == 200
        pids = server.stage_pids("engine") + server.rank_pids()
        assert len(pids) == 2
        started = time.monotonic()
        assert server.terminate(timeout=30) == 0, server.log()[-3000:]
        wait_until(lambda: not any(pid_alive(p) for p in pids), "every rank to exit", 10)
        assert time.monotonic() - started < 20
        assert "did not stop" not in server.log()  # the launcher never had to kill the engine
    finally:
        server.kill()


def test_a_tp2_server_whose_rank_dies_restarts_its_engine_and_still_stops_on_sigterm(model_dir, tmp_path) -> None:
    server = _tp2_server(model_dir, tmp_path)
    try:
        engine, rank = server.stage_pids("engine")[0], server.rank_pids()[0]
        os.kill(rank, signal.SIGKILL)
        wait_until(lambda: not pid_alive(engine), "the engine to notice its rank died and exit", 30)
        wait_until(lambda: len(server.stage_pids("engine")) == 2 and len(server.rank_pids()) == 2
                   and httpx.get(f"{server.url}/health", timeout=5).status_code == 200,
                   "the engine and its rank to be restarted", 240)
        assert _complete(server).status_code == 200
        pids = server.stage_pids("engine") + server.rank_pids()
        assert server.terminate(timeout=30) == 0, server.log()[-3000:]
        wait_until(lambda: not any(pid_alive(p) for p in pids), "every process to exit", 10)
    finally:
        server.kill()


_GREEDY = """
import faulthandler, json, sys
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol.sampling import SamplingParams

faulthandler.dump_traceback_later(150, exit=True)  # a hang fails with every thread's stack
eng = LLMEngine({model!r}, EngineConfig(tp=2, load_format="dummy", dtype="bfloat16", cache_max_entry_count=0.1,
                                        tp_all_reduce={all_reduce!r}, eager_mode={eager!r}))
prompts = [[1 + (7 * i + j) % 3000 for j in range(5 + 13 * i)] for i in range(6)]
params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs={logprobs!r})
for i, p in enumerate(prompts):
    eng.add_request(p, params, request_id=str(i))
out = {{str(i): [] for i in range(len(prompts))}}
while eng.has_work:
    for o in eng.step():
        if o.token is not None:
            out[o.request_id].append(o.token)
eng.close()
print("TOKENS", json.dumps([out[str(i)] for i in range(len(prompts))]), flush=True)
"""


def _greedy_tokens(model_dir: Path, all_reduce: str, eager: bool, logprobs: int | None = None) -> list[list[int]]:
    """Greedy tokens of six prompts of 5..70 tokens, from an engine in a process of its own (a
    peer path maps its buffers once a process: ``check_all_reduce``). With ``logprobs`` (which
    needs the whole row) every step gathers the logits for the sampler; without them it takes
    the vocab-parallel argmax."""
    script = _GREEDY.format(model=str(model_dir), all_reduce=all_reduce, eager=eager, logprobs=logprobs)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200,
                         env={**os.environ, **MULTICAST_OFF})
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert run.returncode == 0 and lines, (run.stdout[-2000:], run.stderr[-4000:])
    return json.loads(lines[-1][len("TOKENS "):])


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_the_fused_all_reduce_gives_nccls_tokens(model_dir, eager) -> None:
    """The all-reduce summed inside the norm's kernel (peer reads over NVLink) against NCCL's
    all-reduce then the norm, on the same random weights (the same seed on each rank): the same
    roundings in the same order, so the same greedy tokens, decode graphs and eager steps alike."""
    assert _greedy_tokens(model_dir, "fused", eager) == _greedy_tokens(model_dir, "nccl", eager)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_greedy_steps_pick_what_the_sampler_picks_on_the_gathered_logits(model_dir, eager) -> None:
    """Each rank's argmax of its vocabulary shard, exchanged over NCCL after the graphs' replay
    (engine/layers/vocab_argmax.py), against rank 0's sampler on the all-gathered bfloat16
    logits of the same random weights: the same ids, bit for bit, ties and all."""
    assert _greedy_tokens(model_dir, "nccl", eager) == _greedy_tokens(model_dir, "nccl", eager, logprobs=0)
