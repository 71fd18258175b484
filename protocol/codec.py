"""Encoding and decoding on a socket: one msgspec Encoder and one typed Decoder, reused."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)


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
        """Every frame already waiting, without blocking. A frame that does not decode as one of
        this socket's messages is logged and dropped: one bad peer must not stop a stage."""
        out = []
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                out.append(self._decoder.decode(frame.buffer))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropped an undecodable frame of %d bytes: %s", len(frame.buffer), exc)
