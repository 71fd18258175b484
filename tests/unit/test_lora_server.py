"""LoRA adapters between an HTTP client (or the CLI) and the engine, on the model-free engine.

The ingress app runs on a real ``EngineClient`` whose engine socket is a loopback into a real
``EngineService`` driving ``FakeEngine`` (a request's adapter shifts the fake's tokens, so the
answer shows which adapter it reached); only the tokenizer and detokenizer stages are stood in
for. No sockets, no sleeps.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from conveyor.api_client import APIClient, APIError
from conveyor.cli import build_parser, chat_adapter, _engine_config
from conveyor.errors import EngineConfigError
from conveyor.protocol import (AdapterDone, Addresses, Admitted, Codec, DetokenizerIn, EngineIn, EngineStats,
                               ErrorOut, GenerateReq, IngressIn, LoadAdapter, LoadReport, SamplingParams,
                               TokenizedReq, UnknownAdapterError, UnloadAdapter)
from conveyor.services.detokenizer.batches import Detokenizer
from conveyor.services.detokenizer.process import serve_detokenizer
from conveyor.services.engine.service import EngineService
from conveyor.services.engine_client import EngineClient, RequestError, RequestOutput
from conveyor.services.ingress.app import build_app
from conveyor.testing.fake_engine import FakeEngine, adapter_shift

pytestmark = pytest.mark.anyio
CYCLE = list(range(100, 120))  # the fake engine's tokens
DEADLINE = 10.0


def checkpoint(root: Path, name: str) -> str:
    """A directory that passes for a PEFT checkpoint with the fake engine."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return str(path)


class LoopbackClient(EngineClient):
    """An EngineClient whose messages to the engine are applied at once by an EngineService on a
    FakeEngine, the service's answers dispatched back as the detokenizer would forward them.
    ``generate`` stands in for the tokenizer (one token per word) and the detokenizer (the
    tokens' ids as text); ``requests`` records what reached the engine."""

    def __init__(self, engine: FakeEngine, adapter_paths: dict[str, str] | None = None):
        super().__init__(Addresses.inproc(), "base", 64, adapter_paths=adapter_paths)
        self.engine = engine
        self.service = EngineService(engine, None, self.addresses)  # no sockets: handed over by hand
        self.requests: list[TokenizedReq] = []
        self._set_adapters(engine.stats().adapters)  # as the first heartbeat's LoadReport, before healthy

    @property
    def healthy(self) -> bool:
        return True

    def _answers(self, msg) -> list:
        self.service.handle([msg])
        out = []
        while not self.service._outbox.empty():
            out.append(self.service._outbox.get_nowait())
        return out

    def _send_to_engine(self, msg) -> None:
        for answer in self._answers(msg):
            asyncio.get_running_loop().create_task(self._dispatch(answer))

    async def generate(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        words = (req.prompt or req.messages[-1]["content"]).split()
        tok = TokenizedReq(req.rid, self.reply_to, [1] * len(words), req.params)
        self.requests.append(tok)
        (answer,) = self._answers(tok)
        if isinstance(answer, ErrorOut):
            raise RequestError.from_wire(answer)
        assert isinstance(answer, Admitted)
        tokens, finish = [], None
        while finish is None:
            for o in self.engine.step():
                if o.request_id == req.rid:
                    tokens += [o.token] if o.token is not None else []
                    finish = o.finish_reason
        yield RequestOutput(" ".join(map(str, tokens)), tokens, finish.openai, len(words), len(tokens), 0)


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, str]:
    return {"sql": checkpoint(tmp_path, "sql"), "poems": checkpoint(tmp_path, "poems")}


def http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def chat(model: str | None = None, **kw: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3, "temperature": 0, **kw}
    return {**body, "model": model} if model is not None else body


def expected_tokens(adapter: str | None, n: int = 3) -> str:
    shift = adapter_shift(adapter, len(CYCLE))
    return " ".join(str(CYCLE[(i + shift) % len(CYCLE)]) for i in range(n))


# ---- the wire ------------------------------------------------------------------------------------

def test_the_adapter_messages_round_trip_through_their_socket_unions() -> None:
    cases = [(EngineIn, LoadAdapter("r", "inproc://i", "sql", "/ckpt/sql")), (EngineIn, UnloadAdapter("r", "x", "sql")),
             (DetokenizerIn, AdapterDone("r", "inproc://i", ["sql", "poems"])), (IngressIn, AdapterDone("r", "x", [])),
             (IngressIn, LoadReport("inproc://i", 1.0, EngineStats(adapters=["sql"]))),
             (DetokenizerIn, ErrorOut("r", 404, "no", code="model_not_found", reply_to="inproc://i"))]
    for union, msg in cases:
        codec = Codec(union)
        assert codec.decode(codec.encode(msg)) == msg


def test_the_engine_service_answers_adapter_ops_and_goes_on(adapters: dict[str, str], tmp_path: Path) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, lora=True))
    (done,) = client._answers(LoadAdapter("l1", "inproc://i", "sql", adapters["sql"]))
    assert done == AdapterDone("l1", "inproc://i", ["sql"])
    assert client.service._snapshot.adapters == ["sql"]  # Pings answered from now on list it
    (bad,) = client._answers(LoadAdapter("l2", "inproc://i", "x", str(tmp_path / "missing")))
    assert (bad.status, bad.reply_to) == (400, "inproc://i") and "adapter_config.json" in bad.message
    (taken,) = client._answers(LoadAdapter("l3", "inproc://i", "sql", adapters["poems"]))
    assert taken.status == 400 and "already loaded" in taken.message
    (gone,) = client._answers(UnloadAdapter("u1", "inproc://i", "poems"))
    assert (gone.status, gone.code) == (404, "model_not_found")
    req = TokenizedReq("g1", "inproc://i", [1, 2], SamplingParams(max_new_tokens=2, adapter_name="poems"))
    (refused,) = client._answers(req)
    assert (refused.status, refused.code, refused.rid) == (404, "model_not_found", "g1")
    (ok,) = client._answers(TokenizedReq("g2", "inproc://i", [1, 2], SamplingParams(adapter_name="sql")))
    assert isinstance(ok, Admitted)  # the engine took requests again after each refusal
    (off,) = LoopbackClient(FakeEngine(CYCLE))._answers(LoadAdapter("l4", "x", "sql", adapters["sql"]))
    assert off.status == 400 and "--max-loras" in off.message


async def test_an_adapter_op_fails_with_503_when_the_engine_stops_answering(adapters: dict[str, str]) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, lora=True))
    client._send_to_engine = lambda msg: None  # the engine died with the message
    load = asyncio.ensure_future(client.load_adapter("sql", adapters["sql"]))
    await asyncio.sleep(0)
    client.fail_all("the engine stage stopped")
    with pytest.raises(RequestError) as exc:
        await load
    assert exc.value.status == 503 and "GET /v1/models" in exc.value.message


def test_fake_engine_adapters() -> None:
    engine = FakeEngine(CYCLE)
    assert not engine.lora and engine.adapter_names() == []
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        engine.add_request([1], SamplingParams(adapter_name="nope"))


async def test_adapter_ops_go_round_the_real_ring(adapters: dict[str, str], tmp_path: Path) -> None:
    """EngineClient -> engine service (its threads and sockets) -> detokenizer stage -> EngineClient,
    over inproc sockets: the answers reach the client that asked, and the heartbeat's LoadReports
    carry the list."""
    ctx = zmq.Context()
    addresses = Addresses.inproc()
    stop = threading.Event()
    service = EngineService(FakeEngine(CYCLE, lora=True), ctx, addresses)
    threads = [threading.Thread(target=service.serve, args=(stop,), daemon=True),
               threading.Thread(target=serve_detokenizer, args=(ctx, addresses, Detokenizer(_Vocab()), stop),
                                daemon=True)]
    for t in threads:
        t.start()
    client = EngineClient(addresses, "base", 64, ping_interval=0.02, context=zmq.asyncio.Context.shadow(ctx.underlying))
    client.adapter_timeout = DEADLINE
    await client.start()
    try:
        await asyncio.wait_for(_until(lambda: client.healthy), DEADLINE)  # the heartbeat went round
        assert await client.load_adapter("sql", adapters["sql"]) == ["sql"]
        assert client.adapters == {"sql": adapters["sql"]}
        with pytest.raises(RequestError) as bad:
            await client.load_adapter("x", str(tmp_path / "none"))
        assert bad.value.status == 400 and client.adapters == {"sql": adapters["sql"]}
        with pytest.raises(RequestError) as unknown:
            await client.unload_adapter("poems")
        assert (unknown.value.status, unknown.value.code) == (404, "model_not_found")
        service.call(lambda engine: engine.load_adapter("poems", adapters["poems"]))  # as another ingress would
        await asyncio.wait_for(_until(lambda: "poems" in client.adapters), DEADLINE)  # from a LoadReport
        assert await client.unload_adapter("sql") == ["poems"]
    finally:
        await client.close()
        stop.set()
        for t in threads:
            t.join(5)
        ctx.term()


class _Vocab:
    """The detokenizer stage's tokenizer, for a ring that carries no tokens."""

    def __len__(self) -> int:
        return len(CYCLE)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


# ---- the ingress ---------------------------------------------------------------------------------

async def test_models_lists_the_adapters_with_parent_and_root(adapters: dict[str, str]) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, adapters=adapters), adapter_paths=adapters)
    async with http(build_app(client)) as c:
        cards = (await c.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in cards] == [
            ("base", None, "base"), ("sql", "base", adapters["sql"]), ("poems", "base", adapters["poems"])]
        one = (await c.get("/v1/models/poems")).json()
        assert (one["id"], one["parent"], one["root"]) == ("poems", "base", adapters["poems"])
        missing = await c.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_model_names_the_adapter_a_request_runs_with(adapters: dict[str, str]) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, adapters=adapters), adapter_paths=adapters)
    async with http(build_app(client)) as c:
        for model in ("sql", "poems", "base", None):
            r = await c.post("/v1/chat/completions", json=chat(model))
            assert r.status_code == 200, r.text
            adapter = model if model in adapters else None
            assert client.requests[-1].params.adapter_name == adapter
            assert r.json()["choices"][0]["message"]["content"] == expected_tokens(adapter)
        r = await c.post("/v1/completions", json={"model": "poems", "prompt": "x y", "max_tokens": 2})
        assert r.status_code == 200 and client.requests[-1].params.adapter_name == "poems"
        assert r.json()["choices"][0]["text"] == expected_tokens("poems", 2)
        assert expected_tokens("poems") != expected_tokens("sql") != expected_tokens(None)

        unknown = await c.post("/v1/chat/completions", json=chat("nope"))
        err = unknown.json()["error"]
        assert unknown.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
        assert all(f"`{name}`" in err["message"] for name in ("nope", "base", "sql", "poems"))
        both = await c.post("/v1/chat/completions", json=chat("sql", adapter_name="poems"))
        assert both.status_code == 400 and both.json()["error"]["param"] == "adapter_name"
        same = await c.post("/v1/chat/completions", json=chat("sql", adapter_name="sql"))
        assert same.status_code == 200 and client.requests[-1].params.adapter_name == "sql"
        lmdeploy = await c.post("/v1/chat/completions", json=chat(adapter_name="poems"))
        assert lmdeploy.status_code == 200 and client.requests[-1].params.adapter_name == "poems"
        per_request = await c.post("/v1/chat/completions", json=chat(lora_path=adapters["sql"]))
        assert per_request.status_code == 400 and "load_lora_adapter" in per_request.json()["error"]["message"]


async def test_interactive_takes_adapter_name(adapters: dict[str, str]) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, adapters=adapters))
    async with http(build_app(client)) as c:
        r = await c.post("/v1/chat/interactive", json={"prompt": "a b", "adapter_name": "sql",
                                                       "request_output_len": 3})
        assert r.status_code == 200, r.text
        assert client.requests[-1].params.adapter_name == "sql" and r.json()["text"] == expected_tokens("sql")
        r = await c.post("/v1/chat/interactive", json={"prompt": "a b", "adapter_name": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "adapter_name"


async def test_load_use_unload_then_404(adapters: dict[str, str], tmp_path: Path) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, lora=True))
    async with http(build_app(client)) as c:
        assert (await c.post("/v1/chat/completions", json=chat("sql"))).status_code == 404
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["sql"]})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        assert [(m["id"], m["root"]) for m in (await c.get("/v1/models")).json()["data"]][1:] == [
            ("sql", adapters["sql"])]
        r = await c.post("/v1/chat/completions", json=chat("sql"))
        assert r.status_code == 200 and client.requests[-1].params.adapter_name == "sql"

        bad = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        again = await c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["sql"]})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        base = await c.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": adapters["sql"]})
        assert base.status_code == 400
        empty = await c.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": adapters["sql"]})
        assert empty.status_code == 400
        assert (await c.post("/v1/chat/completions", json=chat("sql"))).status_code == 200  # still serving

        by_id = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 1})
        assert by_id.status_code == 400 and by_id.json()["error"]["param"] == "lora_int_id"  # not ignored
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
        gone = await c.post("/v1/chat/completions", json=chat("sql"))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        twice = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert twice.status_code == 404 and twice.json()["error"]["param"] == "lora_name"
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["base"]


async def test_the_adapter_list_follows_the_engines_load_reports(adapters: dict[str, str]) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, lora=True))
    async with http(build_app(client)) as c:
        client.engine.load_adapter("poems", adapters["poems"])  # another ingress of the engine loaded it
        assert (await c.post("/v1/chat/completions", json=chat("poems"))).status_code == 404  # not heard of yet
        await client._dispatch(LoadReport(client.reply_to, 0.0, client.engine.stats()))  # the next heartbeat
        assert (await c.post("/v1/chat/completions", json=chat("poems"))).status_code == 200
        assert [(m["id"], m["root"]) for m in (await c.get("/v1/models")).json()["data"]][1:] == [("poems", None)]
        client.engine.unload_adapter("poems")
        await client._dispatch(LoadReport(client.reply_to, 0.0, client.engine.stats()))
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["base"]


async def test_adapter_routes_need_the_api_key(adapters: dict[str, str]) -> None:
    client = LoopbackClient(FakeEngine(CYCLE, lora=True))
    async with http(build_app(client, api_keys=["k1"])) as c:
        load = {"lora_name": "sql", "lora_path": adapters["sql"]}
        assert (await c.post("/v1/load_lora_adapter", json=load)).status_code == 401
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 401
        assert client.engine.adapter_names() == []
        key = {"Authorization": "Bearer k1"}
        assert (await c.post("/v1/load_lora_adapter", json=load, headers=key)).status_code == 200
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=key)).status_code == 200


def test_api_client_sends_vllms_bodies() -> None:
    seen: list[tuple[str, dict]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if body.get("lora_name") == "nope":
            return httpx.Response(404, json={"error": {"message": "no", "code": "model_not_found"}})
        if request.url.path == "/v1/chat/interactive":
            return httpx.Response(200, json={"text": "hi", "tokens": 1, "finish_reason": "stop"})
        return httpx.Response(200, text="Success: ...")

    client = APIClient("http://test")
    client._http = httpx.Client(transport=httpx.MockTransport(server), base_url="http://test")
    assert client.load_lora_adapter("sql", "/ckpt/sql") == "Success: ..."
    assert client.unload_lora_adapter("sql") == "Success: ..."
    with pytest.raises(APIError) as exc:
        client.unload_lora_adapter("nope")
    assert exc.value.status == 404 and exc.value.code == "model_not_found"
    assert list(client.chat("a", 7, adapter_name="sql")) == [("hi", 1, "stop")]
    assert seen[:2] == [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/ckpt/sql"}),
                        ("/v1/unload_lora_adapter", {"lora_name": "sql"})]
    assert seen[-1][1]["adapter_name"] == "sql"
    list(client.chat("a", 7))
    assert "adapter_name" not in seen[-1][1]  # None is not sent: a server without LoRA takes the body
    client.close()


# ---- the command line ----------------------------------------------------------------------------

def test_cli_flags_reach_the_engine_config() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "api_server", "m", "--adapters", "sql=/a", "poems=/b=c", "--max-loras", "4",
                              "--max-lora-rank", "32"])
    config = _engine_config(args)
    assert (config.adapters, config.max_loras, config.max_lora_rank) == ({"sql": "/a", "poems": "/b=c"}, 4, 32)
    assert config.lora_enabled
    plain = _engine_config(parser.parse_args(["serve", "api_server", "m"]))
    assert (plain.adapters, plain.max_loras, plain.lora_enabled) == (None, None, False)
    args = parser.parse_args(["chat", "m", "--adapters", "/ckpt/one"])  # one bare path: LMDeploy's 'default'
    assert args.adapters == {"default": "/ckpt/one"} and chat_adapter(args) == "default"
    args = parser.parse_args(["chat", "m", "--adapters", "a=/1", "b=/2", "--adapter-name", "b", "--max-loras", "2"])
    assert chat_adapter(args) == "b" and _engine_config(args).max_loras == 2
    assert chat_adapter(parser.parse_args(["chat", "m", "--adapters", "a=/1", "b=/2"])) == "a"
    assert chat_adapter(parser.parse_args(["chat", "m"])) is None
    with pytest.raises(EngineConfigError, match="--adapter-name c"):
        chat_adapter(parser.parse_args(["chat", "m", "--adapters", "a=/1", "--adapter-name", "c"]))


@pytest.mark.parametrize("flags, says", [
    (["--adapters", "a=/1", "/2"], "name=path"), (["--adapters", "a=/1", "a=/2"], "twice"),
    (["--adapters", "=/1"], "name=path"), (["--max-loras", "0"], "positive"), (["--max-lora-rank", "x"], "integer"),
])
def test_bad_lora_flags_are_argparse_errors(flags: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "api_server", "m", *flags])
    assert exc.value.code == 2 and says in capsys.readouterr().err
