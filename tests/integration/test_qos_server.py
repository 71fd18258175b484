"""QoS user groups through a real `conveyor serve api_server` (real engine and scheduler on the CPU,
a tiny random Llama with SmolLM2's tokenizer, so that steps are fast): a flood of low-priority
streams does not hold back a high-priority user's first token, and a user over its quota gets
429 in OpenAI's envelope until its requests end."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conveyor.testing.server_process import ServerProcess
from unit.tiny_llama import LINEARS, TINY, write_checkpoint

MAX_BATCH = 2  # the engine runs two sequences at a time: the flood queues in its scheduler
FLOOD = 10
TOKENS = 300  # each flood answer: TOKENS steps of a batch of MAX_BATCH (about a second a batch on a CPU)
QOS = {
    "enable_user_qos": True,
    "user_groups": ["vip", "batch"],
    "user_group_map": {
        "vip": [{"id": "alice", "quota_pct": 100}],
        "batch": [{"id": "default", "quota_pct": 80}, {"id": "capped", "quota_pct": 20}],
    },
}
MAX_QUEUED = 20  # capped: 20% of it, 4 generations in flight


def tiny_model_with_smollm2_tokenizer(smollm2_dir: Path, path: Path) -> Path:
    """TINY's shape with SmolLM2's vocabulary and tokenizer files; random weights."""
    vocab, hidden = 49152, TINY["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen) * 0.5,
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": torch.randn(vocab, hidden, generator=gen) * 0.1}
    for i in range(TINY["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden)
        for name, (k, n) in LINEARS.items():
            tensors[f"model.layers.{i}.{name}.weight"] = torch.randn(n, k, generator=gen) * 0.2
    write_checkpoint(path, tensors, vocab_size=vocab, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qos")
    model = tiny_model_with_smollm2_tokenizer(smollm2_dir, tmp / "model")
    (tmp / "qos.json").write_text(json.dumps(QOS))
    srv = ServerProcess(model, "--device", "cpu", "--dtype", "float32", "--max-batch-size", str(MAX_BATCH),
                        "--cache-max-entry-count", "256", "--cache-block-seq-len", "16", "--session-len", "1024",
                        "--max-queued-requests", str(MAX_QUEUED), "--qos-config-path", str(tmp / "qos.json"),
                        log_dir=tmp)
    yield srv
    srv.terminate()


def body(user: str, max_tokens: int = TOKENS, stream: bool = True) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell {user} a story."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, "user": user}


def in_flight(metrics: httpx.Response, name: str = "conveyor_requests_in_flight") -> float:
    """A gauge from the server's /metrics: the ingress's requests in flight, or an engine gauge."""
    line = next(x for x in metrics.text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


async def wait_idle(http: httpx.AsyncClient) -> None:
    """Until the ingress has nothing in flight (an earlier test's aborted requests have ended)."""
    deadline = time.monotonic() + 60
    while in_flight(await http.get("/metrics")) > 0:
        assert time.monotonic() < deadline, "requests stayed in flight"
        await asyncio.sleep(0.05)


def test_flood_of_low_priority_does_not_delay_the_high_priority_first_token(server: ServerProcess) -> None:
    """At most the batch running when the VIP arrives finishes before its first token; first come,
    first served would finish every flood request queued before it. Counted in completions rather
    than seconds: a CPU shared with other work makes a step take 2 ms or 40 ms."""

    async def scenario() -> tuple[int, list[float], float, float]:
        done: list[float] = []  # when each flood request completed
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            await wait_idle(http)
            flood = [asyncio.create_task(http.post("/v1/chat/completions", json=body(f"flood-{i}", stream=False)))
                     for i in range(FLOOD)]
            for task in flood:
                task.add_done_callback(lambda _: done.append(time.monotonic()))
            deadline = time.monotonic() + 60
            while in_flight(await http.get("/metrics"), "conveyor_engine_requests_waiting") < FLOOD - MAX_BATCH:
                assert time.monotonic() < deadline and not done, "the flood never queued in the engine"
                await asyncio.sleep(0.02)
            done_at_send, sent = len(done), time.monotonic()
            async with http.stream("POST", "/v1/chat/completions", json=body("alice", 4)) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and \
                            any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                        first = time.monotonic()
                        break
            for task in flood:  # the rest of the flood is not needed: the clients go, the engine aborts
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        return done_at_send, [t for t in done if t < first], sent, first

    done_at_send, done_before_first, sent, first = asyncio.run(scenario())
    # The flood was queued when the VIP came: FIFO would have finished all but the last batch first.
    assert done_at_send <= MAX_BATCH, done_at_send
    assert len(done_before_first) - done_at_send <= MAX_BATCH, \
        (f"{len(done_before_first) - done_at_send} flood requests finished before the VIP's first token "
         f"({first - sent:.2f}s after it was sent)")


def test_user_over_quota_gets_429_in_the_openai_envelope(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    async def hold_four_then_ask_a_fifth() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            await wait_idle(http)
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=body("capped", 900, stream=False)))
                    for _ in range(4)]
            while in_flight(await http.get("/metrics")) < 4:  # the engine runs two, two wait
                assert not any(task.done() for task in held), [task.result().text for task in held if task.done()]
                await asyncio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as exc:
                await asyncio.to_thread(client.chat.completions.create, model=model, user="capped", max_tokens=4,
                                        messages=[{"role": "user", "content": "one more"}])
            assert not any(task.done() for task in held)  # the four were still in flight
            for task in held:
                task.cancel()  # the client goes: the engine aborts them and the places come back
            await asyncio.gather(*held, return_exceptions=True)
            return exc.value.response

    resp = asyncio.run(hold_four_then_ask_a_fifth())
    assert resp.status_code == 429 and resp.headers["Retry-After"]
    err = resp.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "user_quota_exceeded" and err["param"] == "user"
    assert "user 'capped' is over its QoS quota: group 'batch' gives it 20%, 4 of the server's 20" in err["message"]
    # Another user of the group is not held back by capped's quota.
    other = client.chat.completions.create(model=model, user="someone", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    assert other.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 30
    while True:  # capped's places come back once its aborted requests have ended
        try:
            again = client.chat.completions.create(model=model, user="capped", max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "capped's places never came back"
            time.sleep(0.1)
    assert again.choices[0].finish_reason == "length"
