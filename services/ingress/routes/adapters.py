"""LoRA adapters at run time, vLLM's routes: ``POST /v1/load_lora_adapter`` and ``POST
/v1/unload_lora_adapter``.

The engine loads or forgets the adapter between two steps and answers; the answer is plain text
as vLLM's (``Success: LoRA adapter 'x' added successfully.``), a failure OpenAI's error envelope
(400 for a bad checkpoint, a name taken or an engine started without LoRA; 404 model_not_found
to unload a name not loaded). Both are under /v1/, so an API key guards them as it guards
generation. Every ingress of the engine learns the new list within a heartbeat (``LoadReport``).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import PlainTextResponse, Response

from ...engine_client import RequestError
from ..flow import ERRORS, Ingress
from ..openai_schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

# Errors are JSON envelopes (ERRORS); a success is vLLM's line of plain text.
_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Success: ..."}}


def install_adapters(app: FastAPI, ing: Ingress) -> None:
    """Add the routes of this module to ``app``."""

    def lora_client():
        if not hasattr(ing.client, "load_adapter"):  # an engine client without LoRA (a test's stand-in)
            raise RequestError(400, "this server cannot load LoRA adapters", param="lora_name")
        return ing.client

    @app.post("/v1/load_lora_adapter", response_class=Response, responses={**ERRORS, **_TEXT})
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        """Load the PEFT LoRA checkpoint at ``lora_path`` (on the server's host) as ``lora_name``;
        requests then name it in ``model``. The engine must have been started with adapters or
        ``--max-loras``."""
        name = body.lora_name
        if name == ing.model_name:
            raise RequestError(400, f"`{name}` is the served model's name: give the adapter another name",
                               param="lora_name")
        await _named_fields(lora_client().load_adapter(name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses={**ERRORS, **_TEXT})
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        """Forget the LoRA adapter ``lora_name``; requests already running with it finish with it."""
        if body.lora_int_id is not None:  # vLLM's own numbering: here adapters are known by name only
            raise RequestError(400, f"lora_int_id={body.lora_int_id}: adapters are unloaded by name here; "
                               "leave lora_int_id out and give lora_name", param="lora_int_id")
        await _named_fields(lora_client().unload_adapter(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _named_fields(op) -> list[str]:
    """Await ``op``; an engine error naming the adapter's field by the engine's name names this body's."""
    try:
        return await op
    except RequestError as exc:
        if exc.param == "adapter_name":
            exc.param = "lora_name"
        raise
