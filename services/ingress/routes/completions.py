"""OpenAI's generation routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (legacy
text completions), JSON or, with ``stream``, server-sent events. ``model`` may name a LoRA
adapter (GET /v1/models lists them): the request then runs with it."""

from __future__ import annotations

import functools
import json
import time

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from ....protocol import GenerateReq
from ...engine_client import RequestError
from ..flow import ERRORS, Ingress, request_id, with_adapter
from ..openai_schemas import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from ..sse import ChatFormat, CompletionFormat
from ..tool_calling import ChoiceParser, plan_tools

_STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE with stream: true"}}


def install_completions(app: FastAPI, ing: Ingress) -> None:
    """Add the routes of this module to ``app``."""
    client, limits, tokenizer = ing.client, ing.limits, ing.tokenizer

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**ERRORS, **_STREAMED})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions (set ``stream`` for server-sent events)."""
        start = time.perf_counter()
        adapter = ing.admit(body.model, body.adapter_name)
        rid, n, k = request_id("chatcmpl"), body.num_choices, body.num_logprobs
        messages = [m.to_wire() for m in body.messages]
        tools = body.tools_wire  # rendered into the prompt too: their text counts
        ing.check_message_chars(messages, len(json.dumps(tools)) if tools else 0)
        # Unbounded by default: the scheduler ends the turn where the context (session_len) is full.
        max_new = body.requested_max_tokens or client.session_len
        params = [with_adapter(body.sampling_params(max_new, k, i), adapter) for i in range(n)]  # body's checks first
        plan = plan_tools(tools, body.tool_choice_wire, body.parallel_tool_calls, ing.chat)
        if plan.guide is not None:  # tool_choice required / named: the calls are the output's grammar
            if params[0].guide is not None:
                raise RequestError(400, f"tool_choice={body.tool_choice_wire!r} constrains the output to tool calls, "
                                   "and the request has another output constraint (response_format / guided_*): "
                                   "send one of them", param="tool_choice")
            params = [msgspec.structs.replace(p, guide=plan.guide) for p in params]
        if plan.keep_special_tokens:  # the format's markers are special tokens: the parser must see them
            params = [msgspec.structs.replace(p, skip_special_tokens=False) for p in params]
        reqs = [GenerateReq(rid=f"{rid}-{i}", reply_to=client.reply_to, messages=messages, params=params[i],
                            tools=plan.tools, **body.template_options) for i in range(n)]
        parsers = None
        if plan.parser is not None or ing.chat.reasoning_parser is not None:
            parsers = functools.partial(ChoiceParser, ing.chat.reasoning_parser, plan.parser, plan.single_call,
                                        ing.chat.generation_prompt)
        fmt = ChatFormat(rid, int(time.time()), ing.model_name, n, ing.renderer, k, body.wants_usage_chunk,
                         parsers=parsers)
        return await ing.respond(request, reqs, fmt, stream=bool(body.stream), n=n, start=start, user=body.user)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**ERRORS, **_STREAMED})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) text completions: no chat template; a batch of prompts gives n choices each."""
        start = time.perf_counter()
        adapter = ing.admit(body.model, body.adapter_name)
        if body.echo and body.logprobs is not None:  # OpenAI's answer would carry the prompt's logprobs too
            raise RequestError(400, "echo with logprobs: the prompt's logprobs are not computed; send echo or "
                               "logprobs, not both", param="echo")
        if body.suffix:
            raise RequestError(400, "suffix: text insertion is not supported; send null", param="suffix")
        rid, n, prompts = request_id("cmpl"), body.num_choices, body.prompts
        if len(prompts) > limits.max_prompts:
            raise RequestError(400, f"{len(prompts)} prompts in one request; this server takes at most "
                               f"{limits.max_prompts}: split the batch", param="prompt", code="too_many_prompts")
        ing.check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        echo: list[str] | None = None
        if body.echo:
            if tokenizer is None and any(isinstance(p, list) for p in prompts):
                raise RequestError(400, "echo of a token-id prompt needs the server's tokenizer: send text",
                                   param="echo")
            try:
                texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
            except Exception as exc:  # ids outside the vocabulary
                raise RequestError(400, f"the prompt's token ids do not decode: {exc}", param="prompt") from exc
            echo = [t for t in texts for _ in range(n)]
        max_new = body.max_tokens or client.session_len  # null: as the chat route, up to the context's end
        reqs = [GenerateReq(rid=f"{rid}-{j * n + i}", reply_to=client.reply_to, do_preprocess=False,
                            prompt=p if isinstance(p, str) else None, input_ids=None if isinstance(p, str) else p,
                            params=with_adapter(body.sampling_params(max_new, body.logprobs, i), adapter))
                for j, p in enumerate(prompts) for i in range(n)]
        fmt = CompletionFormat(rid, int(time.time()), ing.model_name, len(reqs), ing.renderer, body.logprobs,
                               body.wants_usage_chunk, echo=echo)
        return await ing.respond(request, reqs, fmt, stream=bool(body.stream), n=n, start=start, user=body.user)
