"""Every environment variable conveyor reads, declared once: its name, default and meaning.

Engine behaviour is not here: it is a field of ``EngineConfig`` (and a flag of the CLI built
from it), which the tensor-parallel ranks receive with the rest of the config. What stays in the
environment is what a process inherits from whoever starts it: deployment wiring (stage hosts,
key files, keys that must not show in ``ps``), test fixtures, diagnostics, and other projects'
variables that change what we do.

Each accessor reads ``os.environ`` when called, never at import, so a test's
``monkeypatch.setenv`` takes effect; ``get`` refuses a name not declared in ``VARIABLES``, so no
read escapes this table (``tests/unit/test_envs.py`` checks that no other file reads the
environment). This module imports nothing but ``os``: every folder may import it without torch.
"""

from __future__ import annotations

import os

# name -> (default when unset, meaning). The default is the text the variable would hold.
VARIABLES: dict[str, tuple[str | None, str]] = {
    # ---- deployment (the tcp:// topology: compose.yaml) ----
    "CONVEYOR_BIND_HOST": (
        None, "the address a tcp:// stage binds; unset: its own host name resolved (a container on several "
              "networks names the one its peers use)"),
    "CONVEYOR_INGRESS_HOST": ("ingress", "host name of the ingress stage in the tcp:// topology"),
    "CONVEYOR_ENGINE_HOST": ("engine", "host name of the engine stage in the tcp:// topology"),
    "CONVEYOR_DETOKENIZER_HOST": ("detokenizer", "host name of the detokenizer stage in the tcp:// topology"),
    "CONVEYOR_LAUNCHER_HOST": ("launcher", "host name of the launcher in the tcp:// topology"),
    "CONVEYOR_CURVE_KEY_FILE": (
        None, "the deployment's CURVE key file (`conveyor serve keygen FILE`); the tcp:// topology needs it"),
    "CONVEYOR_API_KEYS": (
        "", "accepted API keys, comma-separated, added to --api-keys and --api-keys-file (not visible in ps)"),
    "CONVEYOR_PROXY_ADMIN_KEYS": (
        "", "the proxy's admin keys, comma-separated; an api_server with --proxy-url presents the first"),
    # ---- what a model's files may run ----
    "CONVEYOR_TRUST_REMOTE_CODE": (
        "1", "0 refuses a tokenizer whose model directory ships it as Python (tokenizer_config.json's auto_map: "
             "Qwen-7B's tiktoken, InternLM2's, ...); 1, the default, runs it, as LMDeploy always does"),
    # ---- the default model and the tests ----
    "CONVEYOR_TEST_MODEL": (
        None, "directory of the cached default model (SmolLM2-135M-Instruct); unset: "
              "~/.cache/conveyor/SmolLM2-135M-Instruct"),
    "CONVEYOR_TEST_GGUF": (None, "tests: a GGUF file to load instead of the default model's own"),
    "CONVEYOR_OFFLINE": (None, "tests: any value skips a test whose model is not cached instead of fetching it"),
    "CONVEYOR_FAKE_STEP_DELAY": (
        "0", "the model-free test engine (fake_engine): seconds each step sleeps, to keep requests in flight"),
    # ---- diagnostics ----
    "CONVEYOR_STACK_SAMPLES": (
        None, "a directory: every stage process samples its Python stacks and writes <stage>-<pid>.folded there"),
    # ---- other projects' variables we read ----
    "TRITON_INTERPRET": (
        "0", "Triton's: 1 runs kernels in its CPU interpreter (must be set before triton is imported); read "
             "only when Triton's own state cannot tell"),
    "CUDA_VISIBLE_DEVICES": (None, "CUDA's: which GPUs this process sees (rank r of tensor parallel takes the r-th)"),
}

_TRUE = ("1", "true", "yes", "on")


def get(name: str) -> str | None:
    """The value of the declared variable ``name`` now, or its default when unset."""
    default, _ = VARIABLES[name]  # KeyError: declare it above first
    return os.environ.get(name, default)


def is_set(name: str) -> bool:
    """Whether the declared variable ``name`` holds a non-empty value."""
    return bool(get(name))


def flag(name: str) -> bool:
    """The declared variable ``name`` read as a switch (1, true, yes, on)."""
    return (get(name) or "").strip().lower() in _TRUE


def stage_host(stage: str) -> str:
    """Host name of ``stage`` in the tcp:// topology (``CONVEYOR_<STAGE>_HOST``, else the stage's name)."""
    return get(f"CONVEYOR_{stage.upper()}_HOST") or stage


def bind_host() -> str | None:
    """``CONVEYOR_BIND_HOST``, or None when unset or empty."""
    return get("CONVEYOR_BIND_HOST") or None


def curve_key_file() -> str | None:
    """``CONVEYOR_CURVE_KEY_FILE``, or None when unset or empty."""
    return get("CONVEYOR_CURVE_KEY_FILE") or None


def key_list(name: str) -> list[str]:
    """A comma-separated key variable (``CONVEYOR_API_KEYS``, ``CONVEYOR_PROXY_ADMIN_KEYS``) as a list."""
    return [k.strip() for k in (get(name) or "").split(",") if k.strip()]


def default_model_dir() -> str | None:
    """``CONVEYOR_TEST_MODEL`` (where the default model is cached), or None when unset or empty."""
    return get("CONVEYOR_TEST_MODEL") or None


def stack_samples_dir() -> str | None:
    """``CONVEYOR_STACK_SAMPLES``, or None when unset or empty."""
    return get("CONVEYOR_STACK_SAMPLES") or None


def fake_step_delay() -> float:
    """``CONVEYOR_FAKE_STEP_DELAY`` in seconds."""
    return float(get("CONVEYOR_FAKE_STEP_DELAY") or 0)


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (None when unset; "" hides every GPU)."""
    return get("CUDA_VISIBLE_DEVICES")
