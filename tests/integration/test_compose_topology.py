"""compose.yaml, checked and run without Docker.

1. The file against the Compose specification's JSON schema (the copy check-jsonschema ships,
   a test dependency), so CI catches a key compose would reject without a Docker daemon.
2. Its topology as plain processes: every service's command and environment exactly as the file
   gives them (anchors and ``<<`` merges resolved by the YAML loader, ``${VAR:-default}``
   interpolated as compose does), the image's ENV (Dockerfile) underneath, the one-shot services
   (keygen, model-fetch) run to completion first as ``depends_on`` says, the tokenizer scaled to
   3, then an OpenAI request end to end, one tokenizer killed and the rest still serving.

What a container would give and a process cannot, and how the test stands in for it:
- the image's entrypoint ``conveyor`` is ``python -m conveyor.cli``; ``python3`` is this Python;
  relative paths (the image's WORKDIR /app) are the repository root;
- each named volume is a folder under tmp_path, and an argument or environment value under a
  mount point (``/keys/...``, ``/models/...``) is rewritten to that folder. The models volume
  holds the cached test model under the name the image expects, so model-fetch finds it;
- every stage runs on 127.0.0.1: an environment value naming a service (``ingress``) or an
  address on the compose network (``CONVEYOR_BIND_HOST: 172.28.0.11``) becomes 127.0.0.1. Each
  stage owns distinct ports (base+0 ingress, +1 engine, +2 detokenizer, +10 the reply address),
  so sharing one host needs nothing else; ``--base-port`` (a free base instead of the fixed 5550)
  and the ingress's ``--server-port`` (the published host port) / ``--server-name 127.0.0.1``
  are appended, the last value of a flag winning, so the test does not collide with other runs.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from conveyor.testing.server_process import free_base_port, free_port, wait_stages_healthy

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
# What the test sets in the shell compose reads: a small KV cache and context for the CPU; MODEL
# stays unset, so the stages serve the default model (the image's $CONVEYOR_TEST_MODEL).
COMPOSE_ENV = {"SESSION_LEN": "1024", "CACHE_MAX_ENTRY_COUNT": "64"}
SCALE = {"tokenizer": 3}


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_schema() -> dict:
    resources = pytest.importorskip("check_jsonschema.builtin_schemas.vendor",
                                    reason="the compose-spec schema ships with check-jsonschema: pip install '.[test]'")
    from importlib.resources import files

    return json.loads(files(resources).joinpath("compose-spec.json").read_text())


def test_compose_file_matches_the_compose_spec():
    import jsonschema

    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(load_compose())]
    assert not errors, errors
    broken = load_compose()  # the check can fail: a key compose does not know is refused
    broken["services"]["engine"]["comand"] = broken["services"]["engine"].pop("command")
    assert any("comand" in e.message for e in validator.iter_errors(broken))


def interpolate(value, env: dict[str, str]):
    """compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$`` in every string."""
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{(\w+)(?:(:-|-)([^}]*))?\}", one, value)


def image_env() -> dict[str, str]:
    """The Dockerfile's ENV settings (PATH left to this machine)."""
    env = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            env.update(kv.split("=", 1) for kv in shlex.split(line[4:]))
    env.pop("PATH", None)
    return env


class Topology:
    """compose.yaml's services as processes on this host (see the module docstring)."""

    def __init__(self, compose: dict, tmp: Path, model_dir: Path):
        self.compose, self.tmp = interpolate(compose, COMPOSE_ENV), tmp
        self.services = self.compose["services"]
        self.base, self.http_port = free_base_port(), free_port()
        self.volumes = {name: tmp / "volumes" / name for name in self.compose.get("volumes", {})}
        for path in self.volumes.values():
            path.mkdir(parents=True)
        cached = Path(image_env()["CONVEYOR_TEST_MODEL"]).name  # the models volume already holds it
        (self.volumes["models"] / cached).symlink_to(model_dir)
        subnets = [ipaddress.ip_network(c["subnet"]) for n in self.compose.get("networks", {}).values()
                   for c in ((n or {}).get("ipam") or {}).get("config", [])]
        self._is_network_ip = lambda v: any(_ip_in(v, s) for s in subnets)
        self.procs: dict[str, subprocess.Popen] = {}

    def _mounts(self, service: str) -> dict[str, Path]:
        out = {}
        for spec in self.services[service].get("volumes", []):
            name, target = spec.split(":")[:2]
            out[target] = self.volumes[name]
        return out

    def _path(self, value: str, mounts: dict[str, Path]) -> str:
        for target, host in mounts.items():
            if value == target or value.startswith(target + "/"):
                return str(host) + value[len(target):]
        return value

    def argv(self, service: str) -> list[str]:
        spec, mounts = self.services[service], self._mounts(service)
        entry = spec.get("entrypoint", ["conveyor"])  # the image's ENTRYPOINT
        entry = [sys.executable, "-m", "conveyor.cli"] if entry == ["conveyor"] else \
            [sys.executable if a == "python3" else a for a in entry]
        args = [self._path(a, mounts) for a in spec.get("command", [])]
        if args[:2] == ["serve", "stage"]:
            args += ["--base-port", str(self.base)]
            if args[2] == "ingress":
                container_port = spec["ports"][0].rsplit(":", 1)[1]
                assert args[args.index("--server-port") + 1] == container_port
                args += ["--server-port", str(self.http_port), "--server-name", "127.0.0.1"]
        return entry + args

    def env(self, service: str) -> dict[str, str]:
        mounts = self._mounts(service)
        given = {**image_env(), **(self.services[service].get("environment") or {})}
        given = {k: self._path(str(v), mounts) for k, v in given.items()}
        for k, v in given.items():
            if v in self.services or self._is_network_ip(v):
                given[k] = "127.0.0.1"
        return {**os.environ, **given}

    def order(self) -> tuple[list[str], list[str]]:
        """(one-shot services that others wait for, long-running services), by depends_on."""
        one_shot, deps = set(), {}
        for name, spec in self.services.items():
            deps[name] = spec.get("depends_on", {})
            for dep, cond in deps[name].items():
                if cond.get("condition") == "service_completed_successfully":
                    one_shot.add(dep)
        return sorted(one_shot), [n for n in self.services if n not in one_shot]

    def run_once(self, service: str) -> None:
        done = subprocess.run(self.argv(service), env=self.env(service), cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{service}: {done.stdout}{done.stderr}"

    def start(self, service: str, replicas: int) -> None:
        for i in range(replicas):
            name = f"{service}-{i + 1}" if replicas > 1 else service
            log = open(self.tmp / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(self.argv(service), env=self.env(service), cwd=ROOT, stdout=log,
                                                stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def stop(self) -> dict[str, int]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        return codes


def _ip_in(value: str, net) -> bool:
    try:
        return ipaddress.ip_address(value) in net
    except ValueError:
        return False


def test_compose_topology_as_processes(smollm2_dir, tmp_path):
    top = Topology(load_compose(), tmp_path, smollm2_dir)
    one_shot, stages = top.order()
    assert one_shot == ["keygen", "model-fetch"] and set(stages) == {"engine", "detokenizer", "tokenizer", "ingress"}
    for service in one_shot:
        top.run_once(service)
    key = top.volumes["keys"] / "curve.key_secret"
    assert key.exists() and key.stat().st_mode & 0o077 == 0  # written once, private
    try:
        for service in stages:
            top.start(service, SCALE.get(service, 1))
        url = f"http://127.0.0.1:{top.http_port}"
        wait_stages_healthy(top.procs, url, 240, "the compose topology", top.log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        assert model == Path(image_env()["CONVEYOR_TEST_MODEL"]).name  # the default model, as MODEL is unset
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
        assert "Paris" in first.choices[0].message.content

        top.procs["tokenizer-2"].kill()  # one of three workers dies; compose would restart it
        top.procs["tokenizer-2"].wait()
        for i in range(6):  # enough that the ingress's round robin reaches the dead worker's turn
            again = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
            assert again.choices[0].message.content == first.choices[0].message.content, i
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        codes = top.stop()
    del codes["tokenizer-2"]
    assert all(code == 0 for code in codes.values()), codes
