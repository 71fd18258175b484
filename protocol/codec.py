"""Encoding and decoding on a socket: one msgspec Encoder and one typed Decoder, reused."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq


class Codec:
    """msgpack codec for one socket's message union."""

    def __init__(self, union: Any):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, msg: msgspec.Struct) -> bytes:
        """Message -> bytes."""
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> Any:
        """Bytes -> message; a malformed frame raises msgspec.ValidationError / DecodeError."""
        return self._decoder.decode(data)

    def send(self, sock: zmq.Socket, msg: msgspec.Struct, flags: int = 0) -> None:
        """Encode and send one frame."""
        sock.send(self._encoder.encode(msg), flags=flags, copy=False)

    def recv(self, sock: zmq.Socket, flags: int = 0) -> Any:
        """Receive and decode one frame (zmq.Again with NOBLOCK when nothing is waiting)."""
        return self._decoder.decode(sock.recv(flags=flags, copy=False).buffer)

    def recv_all(self, sock: zmq.Socket) -> list[Any]:
        """Every frame already waiting, without blocking."""
        out = []
        while True:
            try:
                out.append(self.recv(sock, zmq.NOBLOCK))
            except zmq.Again:
                return out
