"""CURVE on the tcp:// sockets and the reply-address check, on loopback, without a model.

A peer without the deployment's key must not get a frame in or out of a stage socket; every wait
is a poll with a deadline.
"""

from __future__ import annotations

import os
import stat

import pytest
import zmq

from conveyor.cli import main as cli_main
from conveyor.protocol import Addresses, Codec, CurveKeys, ErrorOut, IngressIn, SecurityError
from conveyor.protocol import security
from conveyor.services.stage import ReplySockets, open_socket

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    security.release(c)
    c.destroy(linger=0)


def _bound(ctx, keys, kind=zmq.PULL) -> tuple[zmq.Socket, str]:
    sock = open_socket(ctx, kind, bind="tcp://127.0.0.1:*", curve=keys)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_a_key_holder_gets_through() -> None:
    keys = CurveKeys.generate()
    server_ctx, client_ctx = zmq.Context(), zmq.Context()  # two processes' worth of contexts
    try:
        pull, addr = _bound(server_ctx, keys)
        push = open_socket(client_ctx, zmq.PUSH, connect=addr, curve=keys, linger_ms=0)
        push.send(b"hello")
        assert pull.poll(5000), "an authenticated client's frame never arrived"
        assert pull.recv() == b"hello"
    finally:
        security.release(server_ctx)
        server_ctx.destroy(linger=0)
        client_ctx.destroy(linger=0)


@pytest.mark.parametrize("client", ["plain", "other key pair", "server key, own secret"])
def test_a_client_without_the_key_is_refused(ctx, client) -> None:
    keys = CurveKeys.generate()
    pull, addr = _bound(ctx, keys)
    intruder_ctx = zmq.Context()
    try:
        push = intruder_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if client != "plain":
            other = CurveKeys.generate()
            push.curve_publickey, push.curve_secretkey = other.public, other.secret
            push.curve_serverkey = keys.public  # even knowing the server's key is not enough
        push.connect(addr)
        for _ in range(5):
            try:
                push.send(b"forged request", zmq.NOBLOCK)
            except zmq.Again:  # never connected: the handshake failed
                break
        assert not pull.poll(1500), "a client without the deployment's key got a frame in"
    finally:
        intruder_ctx.destroy(linger=0)


def test_a_plain_pull_cannot_read_the_tokenizer_feed(ctx) -> None:
    """The ingress binds the feed as a CURVE server: a PULL without the key gets no prompt."""
    keys = CurveKeys.generate()
    feed, addr = _bound(ctx, keys, zmq.PUSH)
    thief_ctx = zmq.Context()
    try:
        thief = thief_ctx.socket(zmq.PULL)
        thief.connect(addr)
        with pytest.raises(zmq.Again):  # no peer ever completes the handshake: nothing to send to
            feed.setsockopt(zmq.SNDTIMEO, 1500)
            feed.send(b"a user's prompt")
        assert not thief.poll(200)
    finally:
        thief_ctx.destroy(linger=0)


def test_the_key_file_is_private_round_trips_and_is_never_overwritten(tmp_path, capsys) -> None:
    path = tmp_path / "curve.key_secret"
    assert cli_main(["serve", "keygen", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    keys = CurveKeys.load(str(path))
    assert len(keys.public) == len(keys.secret) == 40 and keys.secret.decode() not in repr(keys)
    assert cli_main(["serve", "keygen", str(path)]) == 1  # a deployment's key is not replaced by accident
    assert cli_main(["serve", "keygen", str(path), "--keep-existing"]) == 0
    assert CurveKeys.load(str(path)) == keys
    public_only = tmp_path / "public.key"
    public_only.write_text(f'curve\n    public-key = "{keys.public.decode()}"\n')
    with pytest.raises(SecurityError, match="secret key"):
        CurveKeys.load(str(public_only))


def test_tcp_without_keys_is_refused_with_the_fix(monkeypatch, capsys) -> None:
    monkeypatch.delenv("CONVEYOR_CURVE_KEY_FILE", raising=False)
    with pytest.raises(SecurityError, match="conveyor serve keygen"):
        Addresses.tcp()
    assert cli_main(["serve", "stage", "tokenizer", "/nonexistent-model"]) == 2
    assert "CONVEYOR_CURVE_KEY_FILE" in capsys.readouterr().err


def test_reply_addresses_must_be_an_ingress_of_this_deployment(tmp_path) -> None:
    ipc = Addresses.ipc(str(tmp_path))
    assert ipc.is_reply_address(ipc.reply_endpoint().connect)
    assert not ipc.is_reply_address(ipc.engine_in.connect)  # a stage's own socket
    assert not ipc.is_reply_address(f"ipc://{tmp_path}/reply-1/../../elsewhere")
    assert not ipc.is_reply_address("ipc:///tmp/attacker")
    assert not ipc.is_reply_address("tcp://203.0.113.5:80")
    tcp = Addresses.tcp({"ingress": "ingress", "engine": "e", "detokenizer": "d", "launcher": "l"},
                        base_port=5550, curve=CurveKeys.generate())
    assert tcp.is_reply_address(tcp.reply_endpoint().connect)
    assert not tcp.is_reply_address("tcp://203.0.113.5:5560")
    assert not tcp.is_reply_address("tcp://ingress:22")
    inproc = Addresses.inproc()
    assert inproc.is_reply_address(inproc.reply_endpoint().connect)
    assert not inproc.is_reply_address(inproc.engine_in.connect)


def test_reply_sockets_refuse_a_forged_address_and_deliver_a_real_one(tmp_path) -> None:
    ctx = zmq.Context()
    addresses = Addresses.ipc(str(tmp_path))
    reply = addresses.reply_endpoint()
    inbox = open_socket(ctx, zmq.PULL, bind=reply.bind)
    decoy = open_socket(ctx, zmq.PULL, bind=f"ipc://{tmp_path}/decoy")
    replies = ReplySockets(ctx, addresses)
    try:
        replies.send(f"ipc://{tmp_path}/decoy", ErrorOut("forged", 400, "x"))
        replies.send(reply.connect, ErrorOut("real", 400, "x"))
        assert inbox.poll(5000)
        assert Codec(IngressIn).decode(inbox.recv()).rid == "real"
        assert not decoy.poll(300) and replies.refused == 1
    finally:
        replies.close()
        ctx.destroy(linger=0)
