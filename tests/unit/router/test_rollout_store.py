"""A model's rollout in Redis (`RolloutStore`): the phases and their compare-and-set
ends, the refusals, and the per-version outcome windows. Real Redis."""

from __future__ import annotations

import pytest
import redis

from services.common.status import RolloutConflict
from services.router.rollout_store import Outcome, RolloutPhase, RolloutStore, now_ms


def test_a_rollout_starts_and_promotes(client: redis.Redis, namespace: str) -> None:
    store = RolloutStore(client, namespace)
    assert store.read("m").phase is RolloutPhase.NONE and store.read("m").stable == ""
    started = store.start("m", "v2", 0.1, sticky=True)
    assert (started.phase, started.canary, started.weight, started.sticky) == (
        RolloutPhase.RUNNING, "v2", 0.1, True,
    )  # fmt: skip
    assert store.read("m") == started
    with pytest.raises(RolloutConflict, match="rollout of 'v2' running"):
        store.start("m", "v3", 0.2)
    promoted = store.promote("m")
    assert (promoted.phase, promoted.stable) == (RolloutPhase.PROMOTED, "v2")
    with pytest.raises(RolloutConflict, match="no rollout running"):
        store.promote("m")
    with pytest.raises(ValueError, match="'v2' is the stable version"):
        store.start("m", "v2", 0.5)
    again = store.start("m", "v3", 0.5)
    assert (again.stable, again.canary) == ("v2", "v3")


@pytest.mark.parametrize("end", ["abort", "roll_back"])
def test_an_ended_rollout_keeps_the_stable_version(
    client: redis.Redis, namespace: str, end: str
) -> None:
    store = RolloutStore(client, namespace)
    store.start("m", "v2", 0.5)
    ended = store.abort("m", "by hand") if end == "abort" else store.roll_back("m", "errors")
    assert ended.stable == "" and not ended.running
    assert ended.phase is (RolloutPhase.ABORTED if end == "abort" else RolloutPhase.ROLLED_BACK)
    assert store.read("m").reason == ("by hand" if end == "abort" else "errors")
    with pytest.raises(RolloutConflict):  # a second end (another gateway's) is refused
        store.roll_back("m", "late")


def test_bad_starts_are_refused(client: redis.Redis, namespace: str) -> None:
    store = RolloutStore(client, namespace)
    for weight in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="weight must be in"):
            store.start("m", "v2", weight)
    with pytest.raises(ValueError, match="version must not contain '@'"):
        store.start("m", "v@2", 0.5)
    assert store.read("m").phase is RolloutPhase.NONE


def test_an_empty_canary_is_refused_after_a_promote(client: redis.Redis, namespace: str) -> None:
    """Found by the Rollout RPC fuzz: with a named stable version, a start of version ""
    ran a split with no canary."""
    store = RolloutStore(client, namespace)
    store.start("m", "v3", 0.5)
    store.promote("m")
    with pytest.raises(ValueError, match="version must name the canary"):
        store.start("m", "", 0.5)
    assert store.read("m").stable == "v3" and not store.read("m").running


def test_outcome_windows(client: redis.Redis, namespace: str) -> None:
    store = RolloutStore(client, namespace)
    t = now_ms()
    old = Outcome(t - 90_000, False, 0.0, 0.0)
    fresh = [Outcome(t - 1000 + i, i % 2 == 0, 0.25 * i, 0.5) for i in range(5)]
    store.record("m", "v2", [old])
    store.record("m", "v2", fresh)
    window = store.window("m", "v2", t - 60_000)
    assert sorted(window, key=lambda o: o.at_ms) == fresh
    assert store.window("m", "", t - 60_000) == []
