"""``free_port``: ports for the tensor-parallel rendezvous and the test servers."""

from __future__ import annotations

import socket

from conveyor.protocol.addresses import _ephemeral_start, free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_every_offset_is_free() -> None:
    """A peer that connects before the owner binds gets an ephemeral source port; when that is
    the port itself, the socket connects to itself and holds it (the engine's bind then failed
    in CI). A port below the range cannot be anyone's source port."""
    start = _ephemeral_start()
    for _ in range(50):
        port = free_port((0, 1, 2, 3, 10))
        assert 10000 <= port and port + 10 < start
        for offset in (0, 1, 2, 3, 10):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + offset))  # free, as promised


def test_a_taken_port_is_never_handed_out(monkeypatch) -> None:
    import random

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    picks = iter([taken, taken - 1, 12345])  # the first two collide (taken as port or as port + 1)
    monkeypatch.setattr(random.Random, "randrange", lambda self, lo, hi: next(picks))
    try:
        assert free_port((0, 1)) == 12345
    finally:
        held.close()
