"""The launcher's notices and the READY handshake carry the deployment's launcher token: a peer
that can write to a socket cannot announce a stage, or fake one's death (no processes started)."""

from __future__ import annotations

from types import SimpleNamespace

from conveyor.protocol import Addresses, Ready, Stage
from conveyor.services.launcher import Deployment, ServerArgs


def test_a_ready_counts_only_from_a_started_stage_with_the_token() -> None:
    deployment = Deployment(ServerArgs("unused-model"))
    try:
        token = deployment.addresses.launcher_token
        assert len(token) == 32 and token not in repr(deployment.addresses)  # made per deployment, never logged
        deployment.procs["engine"] = SimpleNamespace(pid=4242)
        deployment.procs["tokenizer-0"] = SimpleNamespace(pid=4343)
        assert not deployment._on_ready(Ready(Stage.ENGINE, 9999, {}, token))  # not a process it started
        assert not deployment._on_ready(Ready(Stage.ENGINE, 4242, {"session_len": 1}, "forged"))
        assert not deployment._on_ready(Ready(Stage.ENGINE, 4343, {}, token))  # the tokenizer's pid as the engine
        assert deployment.refused_ready == 3 and deployment.engine_info == {}
        assert deployment._on_ready(Ready(Stage.ENGINE, 4242, {"session_len": 7}, token))
        assert deployment.engine_info == {"session_len": 7}
    finally:
        deployment.procs.clear()
        deployment.stop()


def test_no_launcher_means_no_notice_is_taken() -> None:
    assert not Addresses.inproc().is_launcher_token("")
    assert not Addresses.inproc().is_launcher_token("anything")
