"""LoRA adapters on the real SmolLM2-135M-Instruct (CPU, float32): three PEFT adapters of several
ranks made on it, served beside the base model by one pipeline. Every request's greedy tokens
equal transformers' on the adapter merged into the base (``merge_and_unload``), in one batch that
mixes the three adapters and the base model; ``adapter_name`` picks the adapter as in LMDeploy."""

from __future__ import annotations

import pytest
import torch

from conveyor import EngineConfig, GenerationConfig, PytorchEngineConfig, pipeline
from conveyor.protocol.errors import UnknownAdapterError

from unit.tiny_lora import greedy_batch, hf_greedy, load_base, make_adapter, merged

pytestmark = pytest.mark.slow

N = 16
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
           "Who wrote Hamlet?"]
ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "all16": (16, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "qv8": (8, 8, ("q_proj", "v_proj"), True),
    "mlp4": (4, 16, ("gate_proj", "up_proj", "down_proj"), False),
}


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    """({name: adapter dir}, {name or None: [transformers' greedy tokens per prompt]}, prompt ids)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("smol-lora")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in PROMPTS]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    base = load_base(smollm2_dir)
    torch.manual_seed(0)
    paths, expected = {}, {None: [hf_greedy(base, i, N) for i in ids]}
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        paths[name] = make_adapter(base, root / name, r=r, alpha=alpha, targets=targets, use_rslora=rslora,
                                   seed=seed, scale=0.5)
        expected[name] = [hf_greedy(merged(base, paths[name]), i, N) for i in ids]
        assert expected[name] != expected[None], name  # the adapter changes the answers
    return paths, expected, ids


@pytest.fixture(scope="module")
def pipe(smollm2_dir, setup):
    paths, _, _ = setup
    cfg = PytorchEngineConfig(adapters={k: str(v) for k, v in paths.items()}, cache_max_entry_count=256,
                              block_size=16, device="cpu", dtype="float32")
    with pipeline(str(smollm2_dir), cfg) as p:
        yield p


def test_one_batch_mixing_three_adapters_and_the_base_equals_merged(pipe, setup) -> None:
    _, expected, ids = setup
    names = [None, *ADAPTERS]
    requests = [(i, names[(k + j) % 4]) for k, i in enumerate(ids) for j in range(4)]

    # On the engine's thread: all 16 requests in the same steps.
    got = pipe._stack.call(lambda engine: greedy_batch(engine, requests, N))
    for (prompt, name), tokens in zip(requests, got):
        assert tokens == expected[name][ids.index(prompt)], name


def test_adapter_name_picks_the_adapter_as_in_lmdeploy(pipe, setup) -> None:
    _, expected, _ = setup
    gen = GenerationConfig(max_new_tokens=N, top_k=1, ignore_eos=True)
    for name in ADAPTERS:
        got = pipe(PROMPTS, gen_config=gen, adapter_name=name)
        assert [r.token_ids for r in got] == expected[name], name
    assert [r.token_ids for r in pipe(PROMPTS, gen_config=gen)] == expected[None]
    got = pipe(PROMPTS[:1], gen_config=GenerationConfig(max_new_tokens=N, top_k=1, ignore_eos=True,
                                                        adapter_name="qv8"))
    assert got[0].token_ids == expected["qv8"][0]
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        pipe(PROMPTS[:1], gen_config=gen, adapter_name="nope")
    assert pipe(PROMPTS[:1], gen_config=gen, adapter_name="mlp4")[0].token_ids == expected["mlp4"][0]


def test_engine_config_is_pytorch_engine_config() -> None:
    assert EngineConfig is PytorchEngineConfig


@pytest.fixture(scope="module")
def server(smollm2_dir, setup, tmp_path_factory):
    from conveyor.testing.server_process import ServerProcess

    paths, _, _ = setup
    srv = ServerProcess(smollm2_dir, "--device", "cpu", "--dtype", "float32", "--cache-max-entry-count", "256",
                        "--adapters", f"all16={paths['all16']}", f"mlp4={paths['mlp4']}", "--max-loras", "2",
                        log_dir=tmp_path_factory.mktemp("lora-server"))
    yield srv
    assert srv.terminate() == 0, srv.log()


def test_the_server_runs_the_adapter_its_model_names(server, setup, smollm2_dir) -> None:
    """``model`` = an adapter's name (vLLM's way) through a real server: the merged model's text;
    an adapter loaded at run time, used, unloaded, then 404."""
    openai = pytest.importorskip("openai")
    import httpx
    from transformers import AutoTokenizer

    paths, expected, _ = setup
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    base = next(name for name, m in models.items() if name not in ADAPTERS)
    assert {"all16", "mlp4"} <= set(models) and models["all16"].parent == base

    def chat(model: str, k: int) -> str:
        done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[k]}],
                                              max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
        return done.choices[0].message.content

    for name in ("all16", "mlp4", None):
        assert chat(name or base, 1) == tok.decode(expected[name][1], skip_special_tokens=True), name
    with pytest.raises(openai.NotFoundError):
        chat("qv8", 0)
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "qv8", "lora_path": str(paths["qv8"])})
    assert r.status_code == 200, r.text
    assert chat("qv8", 0) == tok.decode(expected["qv8"][0], skip_special_tokens=True)
    assert chat("all16", 0) == tok.decode(expected["all16"][0], skip_special_tokens=True)  # paged back in
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "qv8"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        chat("qv8", 0)
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert chat(base, 2) == tok.decode(expected[None][2], skip_special_tokens=True)
