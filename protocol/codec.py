"""Encoding and decoding on a socket: one msgspec Encoder and one typed Decoder, reused."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)


class Codec:
    """msgpack codec for one socket's message union."""

    LOG_EVERY_S = 60.0  # a peer that floods bad frames gets one log line a minute, with the count

    def __init__(self, union: Any):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)
        self.dropped = 0  # frames that did not decode (stages report it on pings)
        self._logged_at = -self.LOG_EVERY_S

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
                self.count_dropped(len(frame.buffer), exc)

    def count_dropped(self, size: int, exc: Exception) -> None:
        """Count a frame that did not decode; log it, at most once a minute."""
        self.dropped += 1
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY_S:
            self._logged_at = now
            logger.error("dropped an undecodable frame of %d bytes (%d so far): %s", size, self.dropped, exc)
