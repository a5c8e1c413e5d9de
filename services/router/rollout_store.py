"""A served model's rollout in Redis: which version is stable, which one is the canary
and what share it takes, and the recent outcomes of both, which every gateway writes
and reads.

Lifecycle of a rollout (`RolloutPhase`): an admin `start`s one (model, canary version,
weight, sticky): RUNNING. It ends in one of three ways, each a compare-and-set on the
phase, so two gateways (or a gateway and an admin) cannot both end it:
- `promote`: the canary becomes the stable version (PROMOTED);
- `abort`: an admin stops it, and the stable version keeps everything (ABORTED);
- `roll_back`: a gateway found the canary worse than the stable version (ROLLED_BACK,
  with the reason).
Only RUNNING splits traffic. The hash stays afterwards to show the last outcome, and the
next `start` replaces it.

Outcomes: each gateway appends one `Outcome` per finished request to a per-version list
(`record`), capped at `MAX_OUTCOMES` and expiring when idle. `window(version, since)`
reads back the ones newer than `since` for the rollback decision (`RolloutVerdict`).

Keys (`ns` = the cluster's base namespace, `m` = the model's served name):
- `ns:rollout:m`              HASH {stable, canary, weight, sticky, phase, reason,
  started_ms, changed_ms}
- `ns:rollout:m:outcomes:v`   LIST of "ms ok ttft_s itl_s" strings, newest first
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from services.common.model_config import check_model_name
from services.common.status import RolloutConflict
from services.router.redis_client import reached_a_replica

log = logging.getLogger(__name__)

MAX_OUTCOMES = 5000  # per version: more than a window at any rate one cluster serves
OUTCOME_TTL_S = 3600  # an idle version's outcomes go after an hour


class RolloutPhase(enum.StrEnum):
    NONE = "none"  # no rollout ever started: the stable version takes everything
    RUNNING = "running"
    PROMOTED = "promoted"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True)
class Rollout:
    model: str
    stable: str = ""  # the version everything not split off goes to ("" = unversioned)
    canary: str = ""
    weight: float = 0.0  # the canary's share while RUNNING, in [0, 1]
    sticky: bool = False  # a tenant's requests all go one way (by a hash of the tenant)
    phase: RolloutPhase = RolloutPhase.NONE
    reason: str = ""  # why it ended (a rollback's verdict, an admin's note)
    started_ms: int = 0
    changed_ms: int = 0

    @property
    def running(self) -> bool:
        return self.phase is RolloutPhase.RUNNING

    def to_hash(self) -> dict[str, str]:
        return {
            "stable": self.stable, "canary": self.canary, "weight": repr(self.weight),
            "sticky": "1" if self.sticky else "0", "phase": self.phase.value,
            "reason": self.reason, "started_ms": str(self.started_ms),
            "changed_ms": str(self.changed_ms),
        }  # fmt: skip

    @classmethod
    def from_hash(cls, model: str, raw: dict[str, str]) -> Rollout:
        if not raw:
            return cls(model)
        return cls(
            model, raw.get("stable", ""), raw.get("canary", ""), float(raw.get("weight", 0)),
            raw.get("sticky") == "1", RolloutPhase(raw.get("phase", "none")),
            raw.get("reason", ""), int(raw.get("started_ms", 0)), int(raw.get("changed_ms", 0)),
        )  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    at_ms: int
    ok: bool
    ttft_s: float  # 0 when no token came
    itl_s: float  # mean gap between tokens after the first (0 for one token)

    def encode(self) -> str:
        return f"{self.at_ms} {int(self.ok)} {self.ttft_s:.6f} {self.itl_s:.6f}"

    @classmethod
    def decode(cls, text: str) -> Outcome:
        at, ok, ttft, itl = text.split()
        return cls(int(at), ok == "1", float(ttft), float(itl))


def now_ms() -> int:
    return int(time.time() * 1000)


def check_start(current: Rollout, canary: str, weight: float) -> None:
    """Whether a rollout of `canary` at `weight` may start over `current`: RolloutConflict
    while one runs, ValueError for a weight outside (0, 1), a bad or empty version name,
    or a canary that is the stable version."""
    if not 0 < weight < 1:
        raise ValueError(f"weight must be in (0, 1), got {weight}")
    check_model_name(canary, "version")
    if not canary:
        # "" is the unversioned pool: once a promote made the stable version a named
        # one, a start of "" would run a split with no canary at all.
        raise ValueError("version must name the canary (it is empty)")
    if current.running:
        raise RolloutConflict(
            f"model {current.model!r} has a rollout of {current.canary!r} running: promote "
            "or abort it first"
        )
    if canary == current.stable:
        raise ValueError(f"version {canary!r} is the stable version of {current.model!r} already")


class RolloutStore:
    """Rollouts of one cluster (`namespace`: its base namespace, where quotas live)."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.client = client
        self.namespace = namespace

    def _key(self, model: str) -> str:
        return f"{self.namespace}:rollout:{check_model_name(model, 'model')}"

    def _outcomes(self, model: str, version: str) -> str:
        return f"{self._key(model)}:outcomes:{check_model_name(version, 'version')}"

    def read(self, model: str) -> Rollout:
        raw = self.client.hgetall(self._key(model))
        return Rollout.from_hash(model, {str(k): str(v) for k, v in raw.items()})

    def start(self, model: str, canary: str, weight: float, *, sticky: bool = False) -> Rollout:
        """Split `weight` of `model`'s requests off to version `canary`; refused as
        `check_start` says."""

        def change(old: Rollout) -> Rollout:
            check_start(old, canary, weight)
            t = now_ms()
            return Rollout(model, old.stable, canary, weight, sticky, RolloutPhase.RUNNING,
                           "", t, t)  # fmt: skip

        return self._change(model, change)

    def promote(self, model: str, reason: str = "promoted") -> Rollout:
        """The running canary becomes the stable version."""
        return self._end(model, RolloutPhase.PROMOTED, reason, promote=True)

    def abort(self, model: str, reason: str = "aborted") -> Rollout:
        return self._end(model, RolloutPhase.ABORTED, reason)

    def roll_back(self, model: str, reason: str) -> Rollout:
        return self._end(model, RolloutPhase.ROLLED_BACK, reason)

    def _end(
        self, model: str, phase: RolloutPhase, reason: str, *, promote: bool = False
    ) -> Rollout:
        def change(old: Rollout) -> Rollout:
            if not old.running:
                raise RolloutConflict(
                    f"model {model!r} has no rollout running (it is {old.phase.value})"
                )
            stable = old.canary if promote else old.stable
            return Rollout(model, stable, old.canary, old.weight, old.sticky, phase, reason,
                           old.started_ms, now_ms())  # fmt: skip

        return self._change(model, change)

    def _change(self, model: str, change: Callable[[Rollout], Rollout]) -> Rollout:
        """Read, change and write the rollout atomically (WATCH: retried when another
        writer got in between). With Sentinel it then waits for a replica to have it, so
        a failover right after does not undo a promotion or a rollback."""
        key = self._key(model)
        while True:
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    raw = pipe.hgetall(key)
                    old = Rollout.from_hash(model, {str(k): str(v) for k, v in raw.items()})
                    new = change(old)
                    pipe.multi()
                    pipe.hset(key, mapping=new.to_hash())  # type: ignore[arg-type]
                    pipe.execute()
                except redis.WatchError:
                    continue
            if not reached_a_replica(self.client):
                log.warning("rollout of %r: no replica acknowledged the change yet", model)
            return new

    # -- outcomes ----------------------------------------------------------------------
    def record(self, model: str, version: str, outcomes: Sequence[Outcome]) -> None:
        if not outcomes:
            return
        key = self._outcomes(model, version)
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(key, *(o.encode() for o in outcomes))
        pipe.ltrim(key, 0, MAX_OUTCOMES - 1)
        pipe.expire(key, OUTCOME_TTL_S)
        pipe.execute()

    def window(self, model: str, version: str, since_ms: int) -> list[Outcome]:
        """The version's outcomes stamped at or after `since_ms` (of the last
        `MAX_OUTCOMES`)."""
        raw = self.client.lrange(self._outcomes(model, version), 0, MAX_OUTCOMES - 1)
        out = []
        for item in raw:
            outcome = Outcome.decode(str(item))
            # Gateways' clocks differ, so the list is only roughly newest first: skip the
            # old ones rather than stop at the first.
            if outcome.at_ms >= since_ms:
                out.append(outcome)
        return out
