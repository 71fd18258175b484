"""QoS user groups (``--qos-config-path``, LMDeploy's file format): who goes first, and how much
of the server one user may hold.

The file::

    {"enable_user_qos": true,
     "user_groups": ["Platinum", "Gold", "Silver", "Bronze"],          # highest priority first
     "user_group_map": {"Platinum": [{"id": "user_id0", "quota_pct": 100},
                                     {"id": "default", "quota_pct": 0}], ...}}

A request's user is the OpenAI body's ``user`` (``user_id`` on /v1/chat/interactive, as
LMDeploy's QoS bodies name it). Each user id belongs to one group; the ``default`` entry stands
for every user the file does not name (and for requests that name none), all of them together,
in the first group whose ``default`` has a quota above 0 (LMDeploy's own template puts them in
Silver). ``quota_pct`` is the user's share of its group (shares are normalized within the group,
as LMDeploy does) and means two things here:

* ordering (LMDeploy's strategy 2): a request from a user holding less than its share of the
  group's requests in flight goes before the group's requests from users over their share;
* a cap: a user may hold at most its share of the ingress's queue (``--max-queued-requests``)
  in flight; past it the request gets 429 with Retry-After. A quota of 0 is a user that may not
  send requests (403), as is an unnamed user when no group takes unnamed users.

Groups are strictly ordered (strategy 1): the engine's scheduler admits waiting requests of a
better group first, and never withdraws a running request for one (docs/architecture.md, "QoS").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ...protocol import ConveyorError
from ..engine_client import RETRY_AFTER_S, RequestError

DEFAULT_USER = "default"  # LMDeploy's name for "every user the file does not name"
_KEYS = {"enable_user_qos", "user_groups", "user_group_map"}
_ENTRY_KEYS = {"id", "quota_pct"}


class QosConfigError(ConveyorError, ValueError):
    """The QoS config file is unreadable or not in LMDeploy's format; the message names the problem."""


@dataclass(frozen=True)
class QosConfig:
    """A parsed and checked QoS file: the groups, best first, and each user's group and share."""

    enabled: bool
    groups: tuple[str, ...]
    group_of: dict[str, int] = field(default_factory=dict)  # user id -> group index (not DEFAULT_USER)
    share: dict[tuple[int, str], float] = field(default_factory=dict)  # (group, id or DEFAULT_USER) -> in [0, 1]
    default_group: int | None = None  # where unnamed users go; None: they are refused

    @classmethod
    def load(cls, path: str | Path) -> "QosConfig":
        """Read and check ``path``; raises QosConfigError naming the file and what is wrong."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise QosConfigError(f"--qos-config-path {path}: cannot read it ({exc.strerror or exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise QosConfigError(f"--qos-config-path {path}: not JSON ({exc})") from None
        try:
            return cls.parse(data)
        except QosConfigError as exc:
            raise QosConfigError(f"--qos-config-path {path}: {exc}") from None

    @classmethod
    def parse(cls, data: object) -> "QosConfig":
        """Check a decoded QoS file (see the module docstring for the format)."""
        if not isinstance(data, dict):
            raise QosConfigError("the file must hold a JSON object with enable_user_qos, user_groups and "
                                 "user_group_map")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise QosConfigError(f"unknown key(s) {unknown}: the keys are {sorted(_KEYS)}")
        missing = sorted(_KEYS - set(data))
        if missing:
            raise QosConfigError(f"missing key(s) {missing}")
        enabled, groups, group_map = data["enable_user_qos"], data["user_groups"], data["user_group_map"]
        if not isinstance(enabled, bool):
            raise QosConfigError(f"enable_user_qos must be true or false, not {enabled!r}")
        if not isinstance(groups, list) or not groups or not all(isinstance(g, str) and g for g in groups):
            raise QosConfigError("user_groups must be a non-empty list of group names, highest priority first")
        if len(set(groups)) != len(groups):
            raise QosConfigError(f"user_groups names a group twice: {groups}")
        if not isinstance(group_map, dict) or set(group_map) != set(groups):
            have = sorted(group_map) if isinstance(group_map, dict) else group_map
            raise QosConfigError(f"user_group_map must have one entry per group of user_groups {groups}, "
                                 f"has {have}")
        config = cls(enabled, tuple(groups))
        for rank, group in enumerate(groups):
            config._add_group(rank, group, group_map[group])
        defaults = [rank for rank in range(len(groups)) if config.share.get((rank, DEFAULT_USER), 0) > 0]
        object.__setattr__(config, "default_group", defaults[0] if defaults else None)
        return config

    def _add_group(self, rank: int, group: str, entries: object) -> None:
        where = f"user_group_map[{group!r}]"
        if not isinstance(entries, list) or not entries:
            raise QosConfigError(f"{where} must be a non-empty list of {{\"id\": ..., \"quota_pct\": ...}}")
        quotas: dict[str, float] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
                raise QosConfigError(f"{where}[{i}] must be an object with exactly the keys id and quota_pct, "
                                     f"not {entry!r}")
            uid, pct = entry["id"], entry["quota_pct"]
            if not isinstance(uid, str) or not uid:
                raise QosConfigError(f"{where}[{i}].id must be a non-empty string, not {uid!r}")
            if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct <= 100:
                raise QosConfigError(f"{where}[{i}] ({uid}): quota_pct must be a number in [0, 100], not {pct!r}")
            if uid in quotas:
                raise QosConfigError(f"{where} names user {uid!r} twice")
            if uid != DEFAULT_USER and uid in self.group_of:
                raise QosConfigError(f"user {uid!r} is in groups {self.groups[self.group_of[uid]]!r} and {group!r}: "
                                     "a user belongs to one group")
            quotas[uid] = float(pct)
        total = sum(quotas.values())
        if total <= 0:
            raise QosConfigError(f"{where}: every quota_pct is 0; give the group's users shares that add up to 100")
        for uid, pct in quotas.items():
            if uid != DEFAULT_USER:
                self.group_of[uid] = rank
            self.share[(rank, uid)] = pct / total

    def classify(self, user: str | None) -> tuple[int, str]:
        """(group index, accounting id) of a request's user: its own id, or DEFAULT_USER for a user
        the file does not name; raises RequestError 403 for a user that may not send requests."""
        rank = self.group_of.get(user) if user is not None else None
        if rank is not None:
            key = user
        elif self.default_group is not None:
            rank, key = self.default_group, DEFAULT_USER
        else:
            raise RequestError(403, f"user {user!r} is not in this server's QoS config, and no group takes other "
                               f"users (a \"{DEFAULT_USER}\" entry with quota_pct above 0): send a configured `user`",
                               type="permission_error", param="user", code="user_not_allowed")
        if self.share[(rank, key)] == 0:
            raise RequestError(403, f"user {user!r} has quota_pct 0 in QoS group {self.groups[rank]!r}: it may "
                               "not send requests", type="permission_error", param="user", code="user_not_allowed")
        return rank, key


@dataclass(frozen=True)
class Admission:
    """What ``QosGate.admit`` counted in: the engine priority of the request's generations, and
    the places to give back."""

    priority: int
    rank: int
    key: str
    num: int


class QosGate:
    """The ingress's QoS accounting: engine requests in flight per user and per group.

    ``admit`` gives a request's engine priority (lower runs first: two levels per group, the
    group's users under their share first) or refuses it; ``release`` gives its places back.
    """

    def __init__(self, config: QosConfig, max_queued: int):
        self.config = config
        self.max_queued = max_queued
        self.user_inflight: dict[tuple[int, str], int] = {}
        self.group_inflight = [0] * len(config.groups)

    def limit(self, rank: int, key: str) -> int:
        """Engine requests a user may hold in flight: its share of the queue, at least one."""
        # less a hair: 0.3 x 100 is 30.000000000000004 in binary floating point
        return max(1, math.ceil(self.config.share[(rank, key)] * self.max_queued - 1e-9))

    def admit(self, user: str | None, num: int) -> Admission:
        """Count ``num`` engine requests of ``user`` in, or raise RequestError (429 over its
        quota, 403 not allowed)."""
        rank, key = self.config.classify(user)
        held, cap, share = self.user_inflight.get((rank, key), 0), self.limit(rank, key), self.config.share[(rank, key)]
        if held + num > cap:
            who = f"user {user!r}" if key != DEFAULT_USER else \
                f"user {user!r} (counted with every user the QoS config does not name, as {DEFAULT_USER!r})"
            raise RequestError(429, f"{who} is over its QoS quota: group {self.config.groups[rank]!r} gives it "
                               f"{share:.0%}, {cap} of the server's {self.max_queued} queued generations "
                               f"(--max-queued-requests); it has {held} in flight and asked for {num} more: "
                               "retry when some finish", type="rate_limit_exceeded", param="user",
                               code="user_quota_exceeded", retry_after=RETRY_AFTER_S)
        group_held = self.group_inflight[rank]
        # Strategy 2, judged at arrival: behind the requests of the group's users under their share.
        over = group_held > 0 and held / group_held >= share
        self.user_inflight[(rank, key)] = held + num
        self.group_inflight[rank] = group_held + num
        return Admission(2 * rank + int(over), rank, key, num)

    def release(self, admission: Admission) -> None:
        """Give back the places ``admit`` counted in."""
        slot = (admission.rank, admission.key)
        left = self.user_inflight[slot] - admission.num
        if left:
            self.user_inflight[slot] = left
        else:
            del self.user_inflight[slot]
        self.group_inflight[admission.rank] -= admission.num
