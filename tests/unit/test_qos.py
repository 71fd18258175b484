"""QoS user groups: the config file (LMDeploy's format), the ingress's accounting (priority, 429,
403), the scheduler's admission order, and the CLI refusing a bad file before any stage starts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.engine.block_manager import BlockManager
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence, SequenceStatus
from conveyor.protocol import Finish
from conveyor.protocol.sampling import SamplingParams
from conveyor.services.engine_client import RequestError
from conveyor.services.ingress.app import build_app
from conveyor.services.ingress.limits import IngressLimits
from conveyor.services.ingress.qos import DEFAULT_USER, QosConfig, QosConfigError, QosGate

from test_ingress import FakeEngineClient, assert_error, chat_body, http

# LMDeploy's sample configuration (docs: "A Sample QoS Configuration"), as it is published.
LMDEPLOY_SAMPLE = {
    "enable_user_qos": True,
    "user_groups": ["Platinum", "Gold", "Silver", "Bronze"],
    "user_group_map": {
        "Platinum": [{"id": "user_id0", "quota_pct": 100}, {"id": "default", "quota_pct": 0}],
        "Gold": [{"id": "user_id1", "quota_pct": 50}, {"id": "user_id2", "quota_pct": 50}],
        "Silver": [{"id": "user_id3", "quota_pct": 5}, {"id": "default", "quota_pct": 95}],
        "Bronze": [{"id": "user_id4", "quota_pct": 30}, {"id": "user_id5", "quota_pct": 30},
                   {"id": "user_id6", "quota_pct": 40}, {"id": "default", "quota_pct": 0}],
    },
}


def config(**changes) -> dict:
    return {**json.loads(json.dumps(LMDEPLOY_SAMPLE)), **changes}


# ---- the file ----------------------------------------------------------------------------------

def test_lmdeploy_sample_parses() -> None:
    qos = QosConfig.parse(LMDEPLOY_SAMPLE)
    assert qos.enabled and qos.groups == ("Platinum", "Gold", "Silver", "Bronze")
    assert qos.classify("user_id0") == (0, "user_id0")
    assert qos.classify("user_id2") == (1, "user_id2")
    assert qos.classify("user_id6") == (3, "user_id6")
    # Unnamed users (and requests naming none) go to the first group whose default has a quota:
    # Silver here, as in LMDeploy.
    assert qos.classify("someone") == qos.classify(None) == (2, DEFAULT_USER)
    assert qos.share[(2, "user_id3")] == pytest.approx(0.05) and qos.share[(2, DEFAULT_USER)] == pytest.approx(0.95)


def test_quotas_are_shares_within_the_group() -> None:
    qos = QosConfig.parse(config(user_group_map={**LMDEPLOY_SAMPLE["user_group_map"],
                                                 "Gold": [{"id": "user_id1", "quota_pct": 10},
                                                          {"id": "user_id2", "quota_pct": 30}]}))
    assert qos.share[(1, "user_id1")] == pytest.approx(0.25) and qos.share[(1, "user_id2")] == pytest.approx(0.75)


@pytest.mark.parametrize("change, names", [
    ({"enable_user_qos": "yes"}, "enable_user_qos must be true or false"),
    ({"user_groups": []}, "user_groups must be a non-empty list"),
    ({"user_groups": ["Platinum", "Gold", "Silver", "Bronze", "Gold"]}, "names a group twice"),
    ({"user_groups": ["Platinum", "Gold", "Silver"]}, "one entry per group"),
    ({"user_groups": ["Platinum", "Gold", "Silver", "Bronze", "Iron"]}, "one entry per group"),
    ({"enable_qos": True}, "unknown key(s) ['enable_qos']"),
])
def test_bad_top_level_is_named(change: dict, names: str) -> None:
    with pytest.raises(QosConfigError) as exc:
        QosConfig.parse(config(**change))
    assert names in str(exc.value)


def test_missing_key_is_named() -> None:
    data = config()
    del data["user_group_map"]
    with pytest.raises(QosConfigError, match=r"missing key\(s\) \['user_group_map'\]"):
        QosConfig.parse(data)


@pytest.mark.parametrize("gold, names", [
    ([], "user_group_map['Gold'] must be a non-empty list"),
    ([{"id": "user_id1", "quota": 50}], "user_group_map['Gold'][0] must be an object with exactly the keys"),
    ([{"id": "", "quota_pct": 50}], "user_group_map['Gold'][0].id must be a non-empty string"),
    ([{"id": "user_id1", "quota_pct": 150}], "(user_id1): quota_pct must be a number in [0, 100], not 150"),
    ([{"id": "user_id1", "quota_pct": "50"}], "quota_pct must be a number in [0, 100], not '50'"),
    ([{"id": "user_id1", "quota_pct": True}], "quota_pct must be a number in [0, 100], not True"),
    ([{"id": "user_id1", "quota_pct": 50}, {"id": "user_id1", "quota_pct": 50}], "names user 'user_id1' twice"),
    ([{"id": "user_id0", "quota_pct": 100}], "user 'user_id0' is in groups 'Platinum' and 'Gold'"),
    ([{"id": "user_id1", "quota_pct": 0}], "every quota_pct is 0"),
])
def test_bad_group_is_named(gold: list, names: str) -> None:
    with pytest.raises(QosConfigError) as exc:
        QosConfig.parse(config(user_group_map={**LMDEPLOY_SAMPLE["user_group_map"], "Gold": gold}))
    assert names in str(exc.value)


def test_load_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "qos.json"
    bad.write_text("{not json")
    with pytest.raises(QosConfigError, match=rf"--qos-config-path {bad}: not JSON"):
        QosConfig.load(bad)
    with pytest.raises(QosConfigError, match="cannot read it"):
        QosConfig.load(tmp_path / "missing.json")
    bad.write_text(json.dumps(config(user_groups="Gold")))
    with pytest.raises(QosConfigError, match=rf"--qos-config-path {bad}: user_groups must be"):
        QosConfig.load(bad)


# ---- the ingress's accounting ------------------------------------------------------------------

def test_priority_by_group_then_share() -> None:
    gate = QosGate(QosConfig.parse(LMDEPLOY_SAMPLE), max_queued=100)
    assert gate.admit("user_id0", 1).priority == 0  # Platinum, under its share (nothing in flight)
    assert gate.admit("user_id0", 1).priority == 1  # Platinum, holding all of the group's requests
    gold1 = gate.admit("user_id1", 3)
    assert gold1.priority == 2
    assert gate.admit("user_id1", 1).priority == 3  # holds 3 of 3, its share is half
    assert gate.admit("user_id2", 1).priority == 2  # holds 0 of 4: goes before user_id1's
    assert gate.admit("anyone", 1).priority == 4  # Silver, through "default"
    assert gate.admit("user_id4", 1).priority == 6  # Bronze
    gate.release(gold1)
    assert gate.user_inflight[(1, "user_id1")] == 1 and gate.group_inflight[1] == 2


def test_over_quota_is_429_and_places_come_back() -> None:
    gate = QosGate(QosConfig.parse(LMDEPLOY_SAMPLE), max_queued=100)
    held = [gate.admit("user_id3", 1) for _ in range(5)]  # 5% of 100 places
    with pytest.raises(RequestError) as exc:
        gate.admit("user_id3", 1)
    err = exc.value
    assert err.status == 429 and err.code == "user_quota_exceeded" and err.retry_after
    assert err.message == ("user 'user_id3' is over its QoS quota: group 'Silver' gives it 5%, 5 of the server's "
                           "100 queued generations (--max-queued-requests); it has 5 in flight and asked for 1 "
                           "more: retry when some finish")
    gate.admit("someone-else", 50)  # the default entry's share is not user_id3's
    gate.release(held[0])
    gate.admit("user_id3", 1)
    gate.admit("user_id4", 29)
    with pytest.raises(RequestError, match="it has 29 in flight and asked for 2 more"):
        gate.admit("user_id4", 2)  # 30% of 100
    with pytest.raises(RequestError, match="counted with every user the QoS config does not name"):
        gate.admit("someone-else", 46)  # the default entry has 95 places, 50 taken


def test_users_who_may_not_send_get_403() -> None:
    qos = QosConfig.parse(config(user_group_map={**LMDEPLOY_SAMPLE["user_group_map"],
                                                 "Silver": [{"id": "user_id3", "quota_pct": 100}],
                                                 "Gold": [{"id": "user_id1", "quota_pct": 100},
                                                          {"id": "user_id2", "quota_pct": 0}]}))
    assert qos.default_group is None
    gate = QosGate(qos, max_queued=100)
    for user, says in (("stranger", "not in this server's QoS config"), (None, "not in this server's QoS config"),
                       ("user_id2", "has quota_pct 0 in QoS group 'Gold'")):
        with pytest.raises(RequestError) as exc:
            gate.admit(user, 1)
        assert exc.value.status == 403 and says in exc.value.message


@pytest.mark.anyio
async def test_ingress_sets_priority_and_answers_429_in_openai_envelope() -> None:
    engine = FakeEngineClient()
    app = build_app(engine, limits=IngressLimits(max_queued=40), qos=QosConfig.parse(LMDEPLOY_SAMPLE))
    async with http(app) as c:
        vip = await c.post("/v1/chat/completions", json=chat_body(user="user_id0", max_tokens=1))
        assert vip.status_code == 200
        engine.hang_after = 0  # these stay in flight until their client goes
        hung = [asyncio.create_task(c.post("/v1/chat/completions", json=chat_body(user="user_id3")))
                for _ in range(2)]  # 5% of 40 places
        while len(engine.active) < 2:
            await asyncio.sleep(0.01)
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(user="user_id3")), 429)
        assert err["type"] == "rate_limit_exceeded" and err["code"] == "user_quota_exceeded" and err["param"] == "user"
        assert_error(await c.post("/v1/completions", json={"prompt": "hi", "user": "user_id3"}), 429)
        engine.hang_after = None
        interactive = await c.post("/v1/chat/interactive", json={"prompt": "hi there", "user_id": "user_id0"})
        assert interactive.status_code == 200
        for rid in list(engine.active):  # the two end: their places come back
            engine._abort_events[rid].set()
        await asyncio.gather(*hung)
        assert (await c.post("/v1/chat/completions", json=chat_body(user="user_id3"))).status_code == 200
    # Platinum; Silver under its share, then over; Platinum; Silver with nothing in flight again.
    assert [r.priority for r in engine.requests] == [0, 4, 5, 0, 4]
    assert app.state.ingress.qos.user_inflight == {} and app.state.ingress.qos.group_inflight == [0] * 4


@pytest.mark.anyio
async def test_disabled_config_serves_everyone_alike() -> None:
    engine = FakeEngineClient()
    app = build_app(engine, qos=QosConfig.parse(config(enable_user_qos=False)))
    async with http(app) as c:
        for user in ("user_id6", "user_id0", None):
            assert (await c.post("/v1/chat/completions", json=chat_body(user=user))).status_code == 200
    assert [r.priority for r in engine.requests] == [0, 0, 0]


# ---- the scheduler -----------------------------------------------------------------------------

def make(num_blocks=16, max_batch_size=8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_batch_size, 64, 1000)


def seq(n: int, seq_id: int, priority: int = 0) -> Sequence:
    s = Sequence(list(range(100 * seq_id, 100 * seq_id + n)), SamplingParams(max_new_tokens=100), seq_id=seq_id)
    s.priority = priority
    return s


def test_waiting_sequences_are_admitted_best_priority_first_fifo_among_equals() -> None:
    sched = make(max_batch_size=2)
    seqs = [seq(3, i, p) for i, p in enumerate([4, 4, 0, 2, 0, 4])]
    for s in seqs:
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == [2, 4, 3, 0, 1, 5]
    out = sched.schedule()
    assert [item.seq.seq_id for item in out.scheduled] == [2, 4]


def test_equal_priorities_keep_arrival_order() -> None:
    sched = make()
    seqs = [seq(3, i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    assert list(sched.waiting) == seqs


def test_running_sequences_are_not_withdrawn_for_a_better_one() -> None:
    sched = make(max_batch_size=2)
    low = [seq(3, 0, 4), seq(3, 1, 4), seq(3, 2, 4)]
    for s in low:
        sched.add(s)
    sched.update(sched.schedule(), {0: 7, 1: 7})
    vip = seq(3, 9, 0)
    sched.add(vip)
    assert list(sched.waiting) == [vip, low[2]]
    out = sched.schedule()  # the batch is full: vip waits, at the head, for the next free place
    assert [item.seq.seq_id for item in out.scheduled] == [0, 1] and not out.preempted
    sched.update(out, {0: 7, 1: 7})
    sched.finish(low[0], Finish.STOP)
    out = sched.schedule()
    assert [item.seq.seq_id for item in out.scheduled] == [1, 9]


def test_cache_shortage_preempts_the_worst_priority_and_requeues_it_by_priority() -> None:
    sched = make(num_blocks=6)
    a, b, c = seq(8, 0, 2), seq(8, 1, 0), seq(7, 2, 0)  # 2 blocks each
    for s in (a, b, c):
        sched.add(s)
    assert list(sched.waiting) == [b, c, a]
    sched.update(sched.schedule(), {0: 7, 1: 7, 2: 7})
    assert sched.running == [b, c, a] and sched.block_manager.num_free_blocks == 0
    waiting = seq(3, 5, 1)
    sched.add(waiting)
    # b needs a 3rd block: a (priority 2) goes, though c was admitted later; it queues behind the
    # better waiting sequence, not at the head.
    out = sched.schedule()
    assert out.preempted == [a] and [item.seq.seq_id for item in out.scheduled] == [1, 2]
    assert a.status == SequenceStatus.WAITING and list(sched.waiting) == [waiting, a]


def test_preempted_sequence_goes_ahead_of_its_equals() -> None:
    sched = make(num_blocks=4)
    a, b = seq(8, 0), seq(7, 1)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), {0: 7, 1: 7})
    later = seq(3, 2)
    sched.add(later)
    out = sched.schedule()  # a needs a 3rd block: b, the last admitted, goes (as without QoS)
    assert out.preempted == [b] and list(sched.waiting) == [b, later]


# ---- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["serve", "api_server"], ["serve", "stage", "ingress"]])
def test_cli_refuses_a_bad_file_before_starting_anything(tmp_path: Path, capsys, monkeypatch, command) -> None:
    import conveyor.services.launcher as launcher

    monkeypatch.setattr(launcher, "serve", lambda args: pytest.fail("a stage was started"))
    bad = tmp_path / "qos.json"
    bad.write_text(json.dumps(config(user_groups=["Gold"])))
    if "stage" in command:  # a tcp:// stage checks its keys first
        assert main(["serve", "keygen", str(tmp_path / "keys")]) == 0
        command = [*command, "--curve-key-file", str(tmp_path / "keys")]
    assert main([*command, "--qos_config_path", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--qos-config-path {bad}: user_group_map must have one entry per group" in err
