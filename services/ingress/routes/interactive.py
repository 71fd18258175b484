"""LMDeploy's stateful chat, ``POST /v1/chat/interactive``: with ``interactive_mode`` the engine
keeps the session's history between turns; streamed as one JSON object per line. ``adapter_name``
(LMDeploy's field) runs the turn with that LoRA adapter."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from starlette.responses import Response

from ....protocol import GenerateReq
from ...engine_client import RequestError
from ..flow import ERRORS, Ingress, json_response, request_id, with_adapter
from ..openai_schemas import InteractiveRequest, InteractiveResponse
from ..sse import InteractiveFormat

_LINES = {200: {"content": {"application/x-ndjson": {}}, "description": "JSON, or JSON lines with stream: true"}}


def install_interactive(app: FastAPI, ing: Ingress) -> None:
    """Add the route of this module to ``app``."""
    client = ing.client

    @app.post("/v1/chat/interactive", response_model=InteractiveResponse, responses={**ERRORS, **_LINES})
    async def chat_interactive(body: InteractiveRequest, request: Request) -> Response:
        """LMDeploy's stateful chat: with ``interactive_mode`` the server keeps the session's history.

        ``interactive_mode: false`` ends the session (if open) and answers the prompt statelessly;
        ``cancel`` aborts the session's running turn; ``end`` (extension) only ends the session.
        Streamed as one JSON object per line.
        """
        start = time.perf_counter()
        sid = body.session_id
        if body.cancel:
            if sid == -1:
                raise RequestError(400, "cancel needs the session_id of the turn to cancel", param="session_id")
            await client.cancel_session(sid)
            return json_response({"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
                                  "finish_reason": "stop", "session_id": sid})
        if (body.end or not body.interactive_mode) and sid != -1:
            await client.end_session(sid)
        if body.end:
            return json_response({"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
                                  "finish_reason": None, "session_id": sid})
        adapter = ing.admit(None, body.adapter_name)
        if not body.prompt:
            raise RequestError(400, "the prompt is empty: give some text or messages", param="prompt")
        prompt, messages = (body.prompt, None) if isinstance(body.prompt, str) else \
            (None, [m.to_wire() for m in body.prompt])
        if prompt:
            ing.check_prompt_chars(len(prompt), "prompt")
        else:
            ing.check_message_chars(messages or [])
        session_id = None
        if body.interactive_mode:  # the engine keeps the session; it knows whether this is a first turn
            session_id = sid if sid != -1 else ing.new_session_id()
        req = GenerateReq(rid=request_id("interactive"), reply_to=client.reply_to, prompt=prompt, messages=messages,
                          session_id=session_id, sequence_start=None if body.interactive_mode else True,
                          params=with_adapter(body.sampling_params(), adapter))
        fmt = InteractiveFormat(session_id)
        return await ing.respond(request, [req], fmt, stream=body.stream, n=1, start=start, user=body.user_id)
