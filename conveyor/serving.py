"""``conveyor.serve(...)`` and ``conveyor.client(...)``: LMDeploy's Python entry points to a server.

``serve`` runs ``conveyor serve api_server`` in a subprocess with the engine settings of
``backend_config`` as flags, waits until it answers ``/health``, and returns an ``APIClient`` on
it; the client's ``close()`` (also at interpreter exit) stops the server.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from typing import Any

import httpx

from conveyor.api_client import APIClient
from conveyor.engine.config import EngineConfig
from conveyor.services.tokenizer.chat_template import ChatTemplateConfig

_START_TIMEOUT_S = 600.0  # a large model loads and captures its graphs first
# EngineConfig field -> api_server flag (the fields the command line takes).
_ENGINE_FLAGS = {"tp": "--tp", "session_len": "--session-len", "max_batch_size": "--max-batch-size",
                 "cache_max_entry_count": "--cache-max-entry-count", "block_size": "--cache-block-seq-len",
                 "enable_prefix_caching": "--enable-prefix-caching", "max_prefill_token_num": "--max-prefill-token-num",
                 "quant_policy": "--quant-policy", "model_format": "--model-format", "dtype": "--dtype",
                 "device": "--device", "session_idle_timeout": "--session-idle-timeout",
                 "adapters": "--adapters", "max_loras": "--max-loras", "max_lora_rank": "--max-lora-rank"}


class ServedClient(APIClient):
    """An APIClient that owns the server process ``serve`` started (``server``)."""

    def __init__(self, url: str, server: subprocess.Popen, api_key: str | None) -> None:
        super().__init__(url, api_key)
        self.server = server

    def close(self) -> None:
        """Close the connections and stop the server (SIGTERM: it drains, then exits)."""
        super().close()
        if self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(90)
            except subprocess.TimeoutExpired:
                self.server.kill()


def wait_until_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    """Poll ``url``/health until it says 200; RuntimeError if ``server`` exits first or ``timeout``
    seconds pass (the caller decides what to do with the process)."""
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the api_server exited with code {server.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the api_server did not answer {url}/health within {timeout:.0f}s")
        time.sleep(0.3)


# Fields folded into others by EngineConfig (cache_block_seq_len -> block_size, ...): their flag is the other's.
_FOLDED = {"cache_block_seq_len", "num_gpu_blocks", "num_tokens_per_iter"}


def _engine_flags(config: EngineConfig) -> list[str]:
    """``config`` as api_server flags; a setting the command line cannot carry is refused, not dropped."""
    default, flags = EngineConfig(), []
    lost = [f.name for f in fields(EngineConfig) if f.name not in _ENGINE_FLAGS and f.name not in _FOLDED
            and getattr(config, f.name) != getattr(default, f.name)]
    if lost:
        raise ValueError(f"serve(): backend_config sets {lost}, which the api_server command line does not take; "
                         f"the settings it takes are {sorted(_ENGINE_FLAGS)}")
    for field, flag in _ENGINE_FLAGS.items():
        value = getattr(config, field)
        if value == getattr(default, field):
            continue
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, dict):  # LoRA adapters: name=path each
            flags += [flag, *(f"{name}={path}" for name, path in value.items())]
        else:
            flags += [flag, str(0 if value is None else value)]
    return flags


def serve(model_path: str, model_name: str | None = None, backend: str = "turbomind",
          backend_config: EngineConfig | None = None, chat_template_config: ChatTemplateConfig | None = None,
          server_name: str = "0.0.0.0", server_port: int = 23333, log_level: str = "ERROR",
          api_keys: str | list[str] | None = None, ssl: bool = False, **kwargs: Any) -> APIClient:
    """Start an api_server for ``model_path`` in a subprocess; returns a client of it (LMDeploy's
    ``lmdeploy.serve``). ``backend`` may be "turbomind" or "pytorch" (one engine serves both);
    extra keyword arguments become flags (``tokenizer_workers=2`` -> ``--tokenizer-workers 2``)."""
    if backend not in ("turbomind", "pytorch"):
        raise ValueError(f"backend={backend!r}: use 'turbomind' or 'pytorch' (one engine serves both)")
    if ssl:
        raise ValueError("ssl=True is not supported: put a TLS-terminating proxy in front of the server")
    args = [sys.executable, "-m", "conveyor.cli", "serve", "api_server", str(model_path),
            "--server-name", server_name, "--server-port", str(server_port), "--log-level", log_level]
    args += _engine_flags(backend_config or EngineConfig())
    if model_name:
        args += ["--model-name", model_name]
    if chat_template_config is not None:
        path = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="conveyor-template-", delete=False)
        json.dump({k: v for k, v in asdict(chat_template_config).items() if v is not None}, path)
        path.close()
        args += ["--chat-template", path.name]
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or [])
    if keys:
        args += ["--api-keys", *keys]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [] if value is False else [flag, str(value)]
    server = subprocess.Popen(args)
    atexit.register(lambda: server.poll() is None and server.terminate())
    host = "127.0.0.1" if server_name in ("0.0.0.0", "::") else server_name
    url = f"http://{host}:{server_port}"
    try:
        wait_until_healthy(server, url, _START_TIMEOUT_S)
    except RuntimeError:
        server.kill()
        raise
    return ServedClient(url, server, keys[0] if keys else None)


def client(api_server_url: str = "http://0.0.0.0:23333", api_key: str | None = None, **kwargs: Any) -> APIClient:
    """A client of a running api_server (LMDeploy's ``lmdeploy.client``)."""
    return APIClient(api_server_url, api_key, **kwargs)
