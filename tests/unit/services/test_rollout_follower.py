"""The rollback verdict (`RollbackPolicy`), the split (`RolloutFollower.pick`: the share
within exact binomial bounds that a split of 0% or of twice the share fails, sticky
tenants), and a follower's tick on real Redis: outcomes sent, the canary's backend made
before any request goes there, a bad canary rolled back once although two gateways judge
it."""

from __future__ import annotations

import redis

from services.gateway.models.rollout_follower import RollbackPolicy, RolloutFollower
from services.router.rollout_store import Outcome, RolloutPhase, RolloutStore, now_ms
from tests import binomial
from tests.binomial import ALPHA

POLICY = RollbackPolicy(window_s=60.0, min_requests=20, error_margin=0.05, latency_margin=0.5)


def _outcomes(n: int, errors: int = 0, ttft: float = 0.1, itl: float = 0.02) -> list[Outcome]:
    t = now_ms()
    return [Outcome(t, i >= errors, ttft, itl) for i in range(n)]


def test_the_verdict() -> None:
    good = _outcomes(40)
    assert POLICY.verdict(good, _outcomes(19, errors=19)) is None  # too few to tell
    assert POLICY.verdict(good, _outcomes(20, errors=1)) is None  # 5%: within the margin
    reason = POLICY.verdict(good, _outcomes(20, errors=2))
    assert reason is not None and reason.startswith("error rate 10.0%")
    slow = POLICY.verdict(good, _outcomes(20, ttft=0.16))
    assert slow is not None and slow.startswith("TTFT p90 0.160s")
    assert POLICY.verdict(good, _outcomes(20, ttft=0.14)) is None  # 40% slower: within
    jerky = POLICY.verdict(good, _outcomes(20, itl=0.04))
    assert jerky is not None and jerky.startswith("ITL p90")
    # Latency needs enough stable requests to compare with; errors do not.
    assert POLICY.verdict(good[:5], _outcomes(20, ttft=1.0)) is None
    assert POLICY.verdict([], _outcomes(20, errors=20)) is not None


def _follower(store: RolloutStore, made: list[str] | None = None) -> RolloutFollower:
    return RolloutFollower(store, "m", POLICY, (made if made is not None else []).append)


def test_the_split_holds_its_share_and_sticky_tenants_stay(
    client: redis.Redis, namespace: str
) -> None:
    store = RolloutStore(client, namespace)
    made: list[str] = []
    follower = _follower(store, made)
    follower.tick()
    assert follower.pick("t") == "" and made == [""]
    store.start("m", "v2", 0.1)
    follower.tick()
    assert sorted(made) == ["", "", "v2"]  # the canary's backend, before its first request
    # Exact binomial bounds at 10%: (138, 269) of 2000. A right split falls outside
    # them with probability 8.4e-7; a split of 20% lands inside with 1.1e-14, one of 0%
    # never does.
    n = 2000
    within = binomial.bounds(n, 0.1)
    assert binomial.accepts(n, 0.0, within) < ALPHA and binomial.accepts(n, 0.2, within) < ALPHA
    canary = sum(follower.pick("t") == "v2" for _ in range(n))
    assert within[0] <= canary <= within[1], (canary, within)
    store.abort("m")
    store.start("m", "v3", 0.3, sticky=True)
    follower.tick()
    tenants = [f"tenant-{i}" for i in range(2000)]
    first = {t: follower.pick(t) for t in tenants}
    assert all(follower.pick(t) == v for t, v in first.items())  # each stays where it went
    # By hash, so the count is fixed; the bounds, (501, 702), still tell 30% from 0 or 60%.
    within = binomial.bounds(len(tenants), 0.3)
    assert binomial.accepts(len(tenants), 0.6, within) < ALPHA
    sticky = sum(v == "v3" for v in first.values())
    assert within[0] <= sticky <= within[1], (sticky, within)


def test_a_bad_canary_is_rolled_back_once(client: redis.Redis, namespace: str) -> None:
    store = RolloutStore(client, namespace)
    store.start("m", "v2", 0.5)
    a, b = _follower(store), _follower(store)
    a.tick()
    b.tick()
    for outcome in _outcomes(30):
        a.observe("", outcome)
    for outcome in _outcomes(20, errors=10):
        b.observe("v2", outcome)
    assert a.tick().running  # a sends the stable outcomes; b's are not in Redis yet
    rolled = b.tick()  # b sends its own, judges, and rolls the canary back
    assert rolled.phase is RolloutPhase.ROLLED_BACK and "error rate 50.0%" in rolled.reason
    assert a.tick() == rolled  # a follows; it does not roll back again
    assert a.pick("t") == "" and b.pick("t") == ""
