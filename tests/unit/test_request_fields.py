"""vLLM's / SGLang's request fields on the ingress (fake engine): each acts (reaches the
engine's SamplingParams or the GenerateReq) or is refused with a 400 naming the alternative;
an unknown field is logged once by name."""

from __future__ import annotations

import json
import logging

import pytest

from test_ingress import PROMPT, assert_error, chat_body, http

from conveyor import GenerationConfig
from conveyor.services.ingress import openai_schemas

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA, sort_keys=True)


def text_body(**kw):
    return {"model": "fake-model", "prompt": PROMPT, **kw}


@pytest.mark.parametrize("fields, kind, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     "json_schema", SCHEMA_TEXT),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA_TEXT),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA_TEXT),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA_TEXT),
    ({"structured_outputs": {"regex": "x+", "disable_any_whitespace": True}}, "regex", "x+"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", '["a"]'),
    ({"structured_outputs": {"grammar": 'root ::= "b"'}}, "grammar", 'root ::= "b"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),  # SGLang's
    ({"ebnf": 'root ::= "c"'}, "grammar", 'root ::= "c"'),
    ({"json_schema": json.dumps(SCHEMA)}, "json_schema", SCHEMA_TEXT),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "regex", "a"),
])
@pytest.mark.parametrize("route", ["chat", "text"])
async def test_each_constraint_field_reaches_the_engine_as_one_guide(app, engine, fields, kind, spec, route) -> None:
    path, body = (("/v1/chat/completions", chat_body(n=2, **fields)) if route == "chat"
                  else ("/v1/completions", text_body(n=2, **fields)))
    async with http(app) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    guides = [req.params.guide for req in engine.requests]
    assert len(guides) == 2 and all(g is not None and (g.kind, g.spec) == (kind, spec) for g in guides)


async def test_text_or_no_format_is_no_guide(app, engine) -> None:
    async with http(app) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body(response_format={"type": "text"}))).is_success
        assert (await c.post("/v1/chat/completions", json=chat_body(structured_outputs={"json_object": False})))\
            .is_success
    assert [req.params.guide for req in engine.requests] == [None, None]


@pytest.mark.parametrize("fields, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, ("response_format", "guided_regex")),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, ("guided_json", "guided_choice")),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, ("guided_regex", "structured_outputs.regex")),
    ({"structured_outputs": {"json": SCHEMA, "choice": ["a"]}},
     ("structured_outputs.json", "structured_outputs.choice")),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, ("regex", "ebnf")),
])
async def test_two_constraints_are_a_400_naming_both(app, engine, fields, names) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(**fields)), 400)
    assert all(name in err["message"] for name in names) and err["param"] == names[1]
    assert not engine.requests


@pytest.mark.parametrize("fields, param, hint", [
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs", "json, regex, choice"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs", "compact"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "leave it out"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]*"}, "guided_whitespace_pattern", "compact"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "response format"),
])
async def test_bad_constraints_are_400s_that_name_the_fix(app, engine, fields, param, hint) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(**fields)), 400)
    assert err["param"] == param and hint in err["message"], err
    assert not engine.requests


async def test_vllm_sampling_extensions_act(app, engine) -> None:
    body = chat_body(min_tokens=3, bad_words=["foo", "bar baz"], no_stop_trim=True, best_of=2, n=2,
                     use_beam_search=False, length_penalty=1.0, spaces_between_special_tokens=True, priority=0,
                     prompt_logprobs=None, allowed_token_ids=[], request_id=None, guided_decoding_backend="auto")
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    p = engine.requests[0].params
    assert (p.min_new_tokens, p.bad_words, p.include_stop_str_in_output) == (3, ["foo", "bar baz"], True)


@pytest.mark.parametrize("field, value, hint", [
    ("best_of", 3, "n=3"),
    ("use_beam_search", True, "temperature"),
    ("length_penalty", 0.5, "beam search"),
    ("spaces_between_special_tokens", False, "skip_special_tokens"),
    ("priority", 1, "--qos-config-path"),
    ("prompt_logprobs", 1, "get_ppl"),
    ("prompt_logprobs", 0, "get_ppl"),
    ("truncate_prompt_tokens", 10, "shorten the prompt"),
    ("allowed_token_ids", [1, 2], "guided_choice"),
    ("logits_processors", ["my.Proc"], "guided_"),
    ("return_tokens_as_token_ids", True, "logprobs"),
    ("request_id", "abc", "response's id"),
    ("cache_salt", "s", "prefix cache"),
    ("kv_transfer_params", {"x": 1}, "disaggregated"),
    ("vllm_xargs", {"x": 1}, "extensions"),
    ("mm_processor_kwargs", {"x": 1}, "multimodal"),
    ("lora_path", "a", "merged model"),
    ("return_hidden_states", True, "hidden states"),
    ("structural_tag", "{}", "json_schema"),
    ("echo", True, "/v1/completions"),
    ("add_special_tokens", True, "BOS"),
    ("documents", [{"title": "t", "text": "x"}], "message"),
    ("chat_template", "{{ messages }}", "--chat-template"),
])
async def test_what_conveyor_does_not_do_is_a_400_naming_the_alternative(app, engine, field, value, hint) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(**{field: value})), 400)
    assert err["param"] == field and hint in err["message"], err
    assert not engine.requests


async def test_text_completion_refusals(app, engine) -> None:
    async with http(app) as c:
        special = assert_error(await c.post("/v1/completions", json=text_body(add_special_tokens=False)), 400)
        beam = assert_error(await c.post("/v1/completions", json=text_body(use_beam_search=True)), 400)
        ok = await c.post("/v1/completions", json=text_body(add_special_tokens=True, min_tokens=1))
    assert special["param"] == "add_special_tokens" and "token ids" in special["message"]
    assert beam["param"] == "use_beam_search" and ok.status_code == 200
    assert engine.requests[0].params.min_new_tokens == 1


async def test_template_options_reach_the_generate_request(app, engine) -> None:
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "The answer is"}]
    async with http(app) as c:
        plain = await c.post("/v1/chat/completions", json=chat_body())
        kwargs = await c.post("/v1/chat/completions", json=chat_body(chat_template_kwargs={"enable_thinking": False},
                                                                     add_generation_prompt=False))
        cont = await c.post("/v1/chat/completions", json=chat_body(messages=messages, continue_final_message=True))
        cont2 = await c.post("/v1/chat/completions", json=chat_body(messages=messages, continue_final_message=True,
                                                                    add_generation_prompt=False))
    assert [r.status_code for r in (plain, kwargs, cont, cont2)] == [200] * 4
    opts = [(r.chat_template_kwargs, r.add_generation_prompt, r.continue_final_message) for r in engine.requests]
    assert opts == [(None, True, False), ({"enable_thinking": False}, False, False), (None, False, True),
                    (None, False, True)]


@pytest.mark.parametrize("fields, param, hint", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt", "false"),
    ({"continue_final_message": True}, "messages", "assistant"),  # the last message is the user's
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "request's own"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs", "special tokens"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "variable name"),
])
async def test_bad_template_options_are_400s(app, engine, fields, param, hint) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(**fields)), 400)
    assert err["param"] == param and hint in err["message"], err
    assert not engine.requests


async def test_unknown_fields_are_logged_once_per_name_and_ignored(app, engine, caplog, monkeypatch) -> None:
    monkeypatch.setattr(openai_schemas, "_LOGGED_UNKNOWN", set())
    caplog.set_level(logging.WARNING, logger=openai_schemas.__name__)
    async with http(app) as c:
        for _ in range(3):
            r = await c.post("/v1/chat/completions", json=chat_body(store=True, metadata={"a": "b"}))
            assert r.status_code == 200
        await c.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "x", "extra": 1}]))
    lines = [rec.getMessage() for rec in caplog.records if rec.name == openai_schemas.__name__]
    assert len(lines) == 3, lines
    assert all(line.startswith("ignored field") for line in lines)
    assert {"'store'", "'metadata'", "'extra'"} == {line.split()[2] for line in lines}
    assert len(engine.requests) == 4


async def test_unknown_field_names_logged_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(openai_schemas, "_LOGGED_UNKNOWN", set())
    for i in range(openai_schemas.MAX_LOGGED_UNKNOWN + 50):
        openai_schemas.ChatCompletionRequest.model_validate({**chat_body(), f"f{i}": 1})
    assert len(openai_schemas._LOGGED_UNKNOWN) == openai_schemas.MAX_LOGGED_UNKNOWN


# ---- pipeline() ----------------------------------------------------------------------------------

STRING_TEMPLATE = ("{%- for m in messages %}{{ '<' + m.role + '>' + m.content }}{%- endfor %}"
                   "{%- if add_generation_prompt %}<assistant>{%- endif %}")


class _FakeStack:
    """LocalStack's surface the pipeline uses: every request answers "ok" at once, and is kept."""

    def __init__(self) -> None:
        self.requests: list = []

    def new_rid(self) -> str:
        return f"r{len(self.requests)}"

    def submit(self, req, sink, tag: int) -> None:
        from conveyor.services.local_stack import RequestOutput

        self.requests.append(req)
        sink.put((tag, RequestOutput("ok", [1], "stop", 1, 1, 0)))

    def abort(self, rids: list[str]) -> None:
        pass


@pytest.fixture(scope="module")
def jinja_dir(tmp_path_factory):
    from test_chat_template_kwargs import tokenizer

    path = tmp_path_factory.mktemp("jinja")
    tokenizer(STRING_TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture
def pipe(jinja_dir):
    """A Pipeline on a tiny tokenizer's Jinja template and a fake engine stack (no model)."""
    import itertools

    from conveyor.pipeline import Pipeline
    from conveyor.services.tokenizer.preprocess import Preprocessor

    p = Pipeline.__new__(Pipeline)
    p.preprocessor = Preprocessor(jinja_dir, 256)
    p._stack = _FakeStack()
    p._session_ids = itertools.count(1)
    return p


def test_pipeline_old_call_arguments_act(pipe) -> None:
    r = pipe("x", request_output_len=7, top_k=3, top_p=0.5, temperature=0.2, repetition_penalty=1.1,
             ignore_eos=True, random_seed=5, stop_words=["."])
    assert r.text == "ok"
    p = pipe._stack.requests[0].params
    assert (p.max_new_tokens, p.top_k, p.top_p, p.temperature, p.repetition_penalty, p.ignore_eos, p.random_seed,
            p.stop_words) == (7, 3, 0.5, 0.2, 1.1, True, 5, ["."])
    pipe.infer(["x", "y"], max_new_tokens=4)
    pipe.batch_infer("x", request_output_len=5)
    list(pipe.stream_infer("x", request_output_len=6))
    pipe.chat("x", top_k=2)
    got = [(r.params.max_new_tokens, r.params.top_k) for r in pipe._stack.requests[1:]]
    assert got == [(4, 1), (4, 1), (5, 1), (6, 1), (512, 2)]
    pipe("x", adapter_name="sql")  # LMDeploy's call argument reaches the request's parameters
    pipe.chat("x", adapter_name="sql", top_k=2)
    assert [r.params.adapter_name for r in pipe._stack.requests[6:]] == ["sql", "sql"]


@pytest.mark.parametrize("call, error, hint", [
    (lambda p: p("x", bogus=1), TypeError, "'bogus'"),
    (lambda p: p("x", top_k=2, gen_config=GenerationConfig()), TypeError, "in the GenerationConfig"),
    (lambda p: p("x", request_output_len=2, max_new_tokens=3), TypeError, "twice"),
    (lambda p: p("x", bad_sequences=[[1]]), TypeError, "gen_config=GenerationConfig"),
    (lambda p: p("x", adapter_name="a", gen_config=GenerationConfig(adapter_name="b")), ValueError,
     "name the LoRA adapter once"),
    (lambda p: p.stream_infer("x", stream_response=False), TypeError, "whole responses"),
    (lambda p: p.stream_infer("x", use_tqdm=True), TypeError, "'use_tqdm'"),
    (lambda p: p.chat("x", sessions=[1]), TypeError, "'sessions'"),
    (lambda p: p("x", chat_template_kwargs={"messages": []}), ValueError, "request's own"),
])
def test_pipeline_arguments_it_cannot_take_raise_naming_the_fix(pipe, call, error, hint) -> None:
    with pytest.raises(error, match=hint):
        call(pipe)
    assert not pipe._stack.requests


def test_pipeline_response_format_and_template_kwargs_reach_the_request(pipe) -> None:
    schema = {"type": "object"}
    gen = GenerationConfig(response_format=dict(type="json_schema", json_schema=dict(name="n", schema=schema)), n=2)
    pipe(["x"], gen, chat_template_kwargs={"enable_thinking": False}, use_tqdm=True)
    pipe("x", response_format={"type": "regex_schema", "regex_schema": "[0-9]+"})
    reqs = pipe._stack.requests
    assert [(r.params.guide.kind, r.params.guide.spec) for r in reqs] == \
        [("json_schema", '{"type": "object"}')] * 2 + [("regex", "[0-9]+")]
    assert [r.chat_template_kwargs for r in reqs] == [{"enable_thinking": False}] * 2 + [None]
    assert GenerationConfig(response_format={"type": "json_object"}).sampling_params().guide.kind == "json_object"
    with pytest.raises(ValueError, match="GenerationConfig.response_format"):
        GenerationConfig(response_format={"type": "yaml"})


def test_pipeline_takes_text_parts_with_a_string_jinja_template(pipe) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert pipe(parts).text == "ok"  # this template concatenates content: a list raised TypeError before
    assert pipe.preprocessor.render(parts) == "<user>a\nb<assistant>"
