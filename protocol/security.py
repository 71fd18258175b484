"""CURVE security for the ``tcp://`` topology: every stage socket encrypted and authenticated.

One key pair per deployment, held by every stage and by no one else. A socket that binds is a
CURVE server; a ZAP handler in its process lets in only clients that present the deployment's
public key, so a peer without the key file cannot connect at all: it cannot submit requests
(which would skip the API key), read prompts off the tokenizer feed, or forge load reports.
Connecting sockets are CURVE clients that also check the server's key, so a stage cannot be
pointed at an impostor. ``ipc://`` needs none of this: its sockets live in a 0700 directory.

The key file is a ZeroMQ (czmq) certificate with both keys; ``conveyor serve keygen FILE``
writes one (mode 0600). Compose generates it once into a volume that only the stages mount.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass

import zmq

from .. import envs


class SecurityError(RuntimeError):
    """The deployment's CURVE keys are missing or unusable."""


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's key pair, Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret (logs, tracebacks)
        return f"CurveKeys(public={self.public.decode()!r})"

    @classmethod
    def generate(cls) -> "CurveKeys":
        """A fresh pair (libzmq's CSPRNG)."""
        _require_curve()
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str) -> "CurveKeys":
        """Read a certificate written by :meth:`save` (or czmq's zcert)."""
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise SecurityError(f"cannot read the CURVE key file {path}: {exc}; "
                                f"write one with `conveyor serve keygen {path}`") from exc
        if not secret:
            raise SecurityError(f"{path} holds only a public key; every stage needs the secret key too "
                                f"(`conveyor serve keygen {path}` writes both)")
        return cls(public, secret)

    @classmethod
    def from_env(cls) -> "CurveKeys | None":
        """The keys named by $CONVEYOR_CURVE_KEY_FILE, or None when it is unset."""
        path = envs.curve_key_file()
        return cls.load(path) if path else None

    def save(self, path: str) -> None:
        """Write both keys to a new file only its owner can read (refuses to overwrite)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("#   conveyor deployment key: every stage holds it, nobody else may read it\n"
                    "metadata\n"
                    "curve\n"
                    f'    public-key = "{self.public.decode()}"\n'
                    f'    secret-key = "{self.secret.decode()}"\n')

    def secure(self, sock: zmq.Socket, *, server: bool) -> None:
        """Make ``sock`` a CURVE server (it will bind) or client (it will connect); call before
        bind/connect. A server's process gets the ZAP handler that checks client keys."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        if server:
            _guard(sock.context, self.public)
            sock.curve_server = True
        else:
            sock.curve_serverkey = self.public


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise SecurityError("this libzmq was built without CURVE; install pyzmq's wheel (it bundles libsodium) "
                            "or use the ipc:// topology")


class _OnlyKey:
    """ZAP credentials check: the deployment's own public key, nothing else."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


_guards: dict[int, tuple[zmq.Context, object]] = {}  # libzmq context address -> (context, its ZAP authenticator)
_guards_lock = threading.Lock()


@atexit.register
def _release_all() -> None:
    """Stop every ZAP handler before the interpreter tears the contexts down: a context whose
    handler still holds sockets would wait for them for ever when it is terminated."""
    for address in list(_guards):
        ctx, _ = _guards[address]
        release(ctx)


def _guard(ctx: zmq.Context, public: bytes) -> None:
    """Start the ZAP handler of ``ctx`` once. It must run before the first client connects: with
    no handler, libzmq lets any CURVE client in."""
    from zmq.auth.thread import ThreadAuthenticator

    _require_curve()
    with _guards_lock:
        if ctx.underlying in _guards:
            return
        # ZAP is per libzmq context; a plain shadow serves asyncio contexts as well.
        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        auth.start()
        auth.configure_curve_callback("*", _OnlyKey(public))
        # Held here, the context outlives the sockets' owners until release() or exit: dropped
        # earlier, its finalizer would terminate it while the handler's sockets are open (a hang).
        _guards[ctx.underlying] = (ctx, auth)


def release(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP handler (its socket would keep ``ctx.term()`` waiting)."""
    with _guards_lock:
        entry = _guards.pop(ctx.underlying, None)
    if entry is not None:
        entry[1].stop()
