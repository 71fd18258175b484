"""Every socket address, built in one place, for the three topologies.

- ``inproc://``: stages are threads of one process (the offline pipeline);
- ``ipc://``: stages are processes on one host, sockets under a private temp dir;
- ``tcp://``: stages are containers; each endpoint is bound on the owner's own address (never
  ``tcp://*``) and reached through its service name, every socket under CURVE (``security.py``).

Results go back to the ``reply_to`` address a request names; :meth:`Addresses.is_reply_address`
lets the stages that connect out to it refuse any address that is not an ingress's.
"""

from __future__ import annotations

import hmac
import os
import random
import socket
import tempfile
import uuid
from dataclasses import dataclass, field

from .. import envs
from .security import CurveKeys, SecurityError


def free_port(offsets: tuple[int, ...] = (0,)) -> int:
    """A TCP port ``p`` with ``p + o`` free on 127.0.0.1 now for every offset ``o`` (the
    tensor-parallel rendezvous, test servers); another process may take it before the caller
    binds it. Below the kernel's ephemeral range, never in it: a peer that connects before the
    owner binds gets an ephemeral source port, and when that is the port itself the socket
    connects to itself and holds it, so the owner's bind then fails with "Address already in
    use" (CI: a tokenizer stage's reconnects took the engine's port while the engine loaded)."""
    rng = random.Random()
    high = _ephemeral_start() - max(offsets) - 1
    while True:
        port = rng.randrange(10000, high)
        if all(_free(port + o) for o in offsets):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ephemeral_start() -> int:
    """The first port the kernel hands out as an outgoing connection's source port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@dataclass(frozen=True)
class Endpoint:
    """Where the owning stage binds, and where its peers connect."""

    bind: str
    connect: str


@dataclass(frozen=True)
class Addresses:
    """The fixed endpoints of one deployment (each ingress's reply address is made per ingress)."""

    tokenizer_in: Endpoint  # bound by the ingress (PUSH); tokenizer workers connect and PULL
    engine_in: Endpoint  # bound by the engine (PULL)
    detokenizer_in: Endpoint  # bound by the detokenizer (PULL)
    launcher: Endpoint  # bound by the launcher (PULL): READY handshakes
    kind: str = "ipc"
    run_dir: str = ""
    base_port: int = 0  # tcp only: the ingress's reply port is base_port + 10
    curve: CurveKeys | None = None  # tcp only: the deployment's keys; every socket is a CURVE socket
    ingress_hosts: tuple[str, ...] = field(default=())  # tcp only: where ingress reply addresses may live
    # A secret the launcher makes and hands its stages (through the process pipe, not argv or the
    # environment): its notices (StageStatus, IngressGone) and the stages' Ready carry it, so a
    # peer that can only write to a socket cannot fake a stage's death or birth. Empty: no launcher.
    launcher_token: str = field(default="", repr=False)

    @classmethod
    def inproc(cls) -> "Addresses":
        """Threads of one process; unique names so several pipelines can coexist."""
        tag = uuid.uuid4().hex[:8]
        ep = lambda name: Endpoint(f"inproc://conveyor-{tag}-{name}", f"inproc://conveyor-{tag}-{name}")
        return cls(ep("tokenizer"), ep("engine"), ep("detokenizer"), ep("launcher"), kind="inproc")

    @classmethod
    def ipc(cls, run_dir: str | None = None) -> "Addresses":
        """Processes on one host, sockets in a fresh private directory."""
        run_dir = run_dir or tempfile.mkdtemp(prefix="conveyor-")
        ep = lambda name: Endpoint(f"ipc://{run_dir}/{name}", f"ipc://{run_dir}/{name}")
        return cls(ep("tokenizer"), ep("engine"), ep("detokenizer"), ep("launcher"), kind="ipc", run_dir=run_dir)

    @classmethod
    def tcp(cls, hosts: dict[str, str] | None = None, base_port: int = 5550,
            curve: CurveKeys | None = None) -> "Addresses":
        """Containers: stage ``name`` is reached at ``tcp://{hosts[name]}:{port}``.

        Defaults follow compose.yaml's service names; CONVEYOR_<NAME>_HOST overrides one. The
        keys default to the file named by $CONVEYOR_CURVE_KEY_FILE; there is no tcp:// without them.
        """
        curve = curve or CurveKeys.from_env()
        if curve is None:
            raise SecurityError("the tcp:// topology needs the deployment's CURVE keys: write them once with "
                                "`conveyor serve keygen FILE` and give every stage CONVEYOR_CURVE_KEY_FILE=FILE "
                                "(compose.yaml does both)")
        hosts = dict(hosts or {})
        names = ("ingress", "engine", "detokenizer", "launcher")
        for n in names:
            hosts.setdefault(n, envs.stage_host(n))

        def ep(owner: str, port: int) -> Endpoint:
            return Endpoint(f"tcp://{_bind_host(hosts[owner])}:{port}", f"tcp://{hosts[owner]}:{port}")

        return cls(ep("ingress", base_port), ep("engine", base_port + 1), ep("detokenizer", base_port + 2),
                   ep("launcher", base_port + 3), kind="tcp", base_port=base_port, curve=curve,
                   ingress_hosts=(hosts["ingress"],))

    def reply_endpoint(self, port: int | None = None, host: str | None = None) -> Endpoint:
        """A fresh address for one ingress to receive its results on."""
        if self.kind == "inproc":
            addr = f"inproc://conveyor-reply-{uuid.uuid4().hex[:8]}"
            return Endpoint(addr, addr)
        if self.kind == "ipc":
            addr = f"ipc://{self.run_dir}/reply-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            return Endpoint(addr, addr)
        host = host or (self.ingress_hosts[0] if self.ingress_hosts else "ingress")
        port = port or self.base_port + 10
        return Endpoint(f"tcp://{_bind_host(host)}:{port}", f"tcp://{host}:{port}")

    def is_launcher_token(self, token: str) -> bool:
        """Whether ``token`` is this deployment's launcher token (never, when it has no launcher)."""
        return bool(self.launcher_token) and hmac.compare_digest(token.encode(), self.launcher_token.encode())

    def is_reply_address(self, address: str) -> bool:
        """Whether ``address`` can be an ingress's reply address in this deployment. A request
        naming any other (another host, a stage's own socket, a path outside the run directory)
        is not answered: the stages never connect out to where a forged request points."""
        if self.kind == "inproc":
            return address.startswith("inproc://conveyor-reply-")
        if self.kind == "ipc":
            prefix = f"ipc://{self.run_dir}/reply-"
            return address.startswith(prefix) and "/" not in address[len(prefix):]
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        return (address.startswith("tcp://") and host in self.ingress_hosts and port.isdigit()
                and self.base_port + 10 <= int(port) < self.base_port + 100)


def _bind_host(name: str) -> str:
    """The IP to bind for a host name that names this machine (binding needs an address).

    CONVEYOR_BIND_HOST wins: a container on several networks sets the one its peers use.
    """
    bound = envs.bind_host()
    if bound:
        return bound
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"
