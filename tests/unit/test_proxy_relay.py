"""The proxy's SSE relay: whole events as they arrive, and a readable end when the node breaks off."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from conveyor.services.proxy.relay import relay_events


class _Body(httpx.AsyncByteStream):
    """A node's body in the given pieces, then optionally a broken connection."""

    def __init__(self, pieces: list[bytes], fail: bool):
        self.pieces, self.fail = pieces, fail

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece
        if self.fail:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def _relay(pieces: list[bytes], fail: bool = False) -> tuple[list[bytes], list[tuple[bool, bool]]]:
    ends: list[tuple[bool, bool]] = []
    upstream = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(pieces, fail))

    async def run() -> list[bytes]:
        return [chunk async for chunk in relay_events(upstream, "http://node", lambda ok, exc: ends.append(
            (ok, exc is not None)))]

    return asyncio.run(run()), ends


def test_events_are_passed_on_whole_as_soon_as_they_are_complete():
    pieces = [b"data: 1\n", b"\ndata: 2\n\nda", b"ta: 3\n\n", b"data: [DONE]\n\n"]
    out, ends = _relay(pieces)
    # each piece passes on every event it completes, nothing more, nothing later
    assert out == [b"data: 1\n\ndata: 2\n\n", b"data: 3\n\n", b"data: [DONE]\n\n"]
    assert ends == [(True, False)]


def test_a_node_breaking_off_ends_the_stream_with_an_error_event_and_done():
    out, ends = _relay([b"data: 1\n\ndata: {\"cut", b" here"], fail=True)
    assert out[0] == b"data: 1\n\n"  # the half event is dropped, never glued to the error
    error, done = out[1].split(b"\n\n")[:2]
    body = json.loads(error.removeprefix(b"data: "))
    assert body["error"]["code"] == "node_failed" and "http://node" in body["error"]["message"]
    assert done == b"data: [DONE]"
    assert ends == [(False, True)]


class _Stalling(httpx.AsyncByteStream):
    """A node's body: the given pieces, then nothing (a node that stalls mid-stream)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece
        await asyncio.sleep(30)


def _relay_with(stream: httpx.AsyncByteStream, **options) -> tuple[list[bytes], list[tuple[bool, Exception | None]]]:
    ends: list[tuple[bool, Exception | None]] = []
    upstream = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    async def run() -> list[bytes]:
        return [chunk async for chunk in relay_events(upstream, "http://node", lambda ok, exc: ends.append((ok, exc)),
                                                      **options)]

    return asyncio.run(run()), ends


def test_a_stream_that_stalls_ends_after_the_chunk_timeout_with_an_error_event():
    start = time.monotonic()
    out, ends = _relay_with(_Stalling([b"data: 1\n\n"]), chunk_timeout_s=0.1)
    assert time.monotonic() - start < 2
    assert out[0] == b"data: 1\n\n"
    body = json.loads(out[1].split(b"\n\n")[0].removeprefix(b"data: "))
    assert body["error"]["code"] == "node_timeout" and out[1].endswith(b"data: [DONE]\n\n")
    assert ends[0][0] is False and isinstance(ends[0][1], httpx.TimeoutException)


def test_an_event_that_never_ends_is_not_held_past_the_cap():
    """A node that never sends a blank line: what is held stays under the cap, then the stream ends."""
    piece = b"data: " + b"x" * 1000
    out, ends = _relay_with(_Body([b"data: 1\n\n"] + [piece] * 100, fail=False), max_event_bytes=10_000)
    assert out[0] == b"data: 1\n\n" and len(out) == 2
    body = json.loads(out[1].split(b"\n\n")[0].removeprefix(b"data: "))
    assert body["error"]["code"] == "node_failed" and out[1].endswith(b"data: [DONE]\n\n")
    assert ends[0][0] is False and "10000 bytes" in str(ends[0][1])
