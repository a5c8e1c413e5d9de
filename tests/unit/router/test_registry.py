from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from services.router.keyspace import Keyspace
from services.router.registry import IncompatibleWorkerError, Registry, keep_registered
from tests.unit.router.conftest import LAYOUT, MODEL, worker

# Run alone (`make test`'s serial phase): heartbeats that must land within a TTL.
pytestmark = pytest.mark.serial


def make(client: redis.Redis, namespace: str, **kw: object) -> Registry:
    return Registry(client, Keyspace(namespace), **kw)  # type: ignore[arg-type]


def test_register_list_heartbeat_deregister(client: redis.Redis, namespace: str) -> None:
    reg = make(client, namespace, ttl_s=5)
    assert reg.register(worker("p0", "prefill", capacity=128)) is True
    assert reg.heartbeat(worker("p0", "prefill", capacity=128)) is False  # renewed, not new
    reg.register(worker("d0", "decode"))
    assert [w.worker_id for w in reg.list()] == ["d0", "p0"]
    (p0,) = reg.list("prefill")
    assert (p0.address, p0.capacity, p0.model, p0.draining) == ("addr-p0", 128, MODEL, False)
    assert reg.identity() == (MODEL, LAYOUT)
    assert reg.deregister("p0") is True and reg.deregister("p0") is False
    assert [w.worker_id for w in reg.list()] == ["d0"]
    reg.deregister("d0")
    assert reg.identity() is None  # the last worker gone: a new model may register


def test_incompatible_worker_is_refused_with_a_clear_message(
    client: redis.Redis, namespace: str
) -> None:
    reg = make(client, namespace)
    reg.register(worker("m0"))
    with pytest.raises(IncompatibleWorkerError, match=r"KV layout 'other'.*live workers") as err:
        reg.register(worker("m1", layout_fingerprint="other"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(IncompatibleWorkerError, match="model 'other-model'"):
        reg.register(worker("m1", "prefill", model="other-model"))
    with pytest.raises(IncompatibleWorkerError, match="already registered as a mixed worker"):
        reg.register(worker("m0", "decode"))
    assert [w.worker_id for w in reg.list()] == ["m0"]


def test_a_refusal_gives_both_layouts_in_words(client: redis.Redis, namespace: str) -> None:
    """Workers of one pool share KV and prefix-cache hits, so numerics the stored dtype
    hides (the compute dtype under an 8-bit cache) refuse a worker; the message says
    how, not just that two hashes differ."""
    reg = make(client, namespace)
    reg.register(worker("m0", layout_text="KV int8, computed in bfloat16"))
    with pytest.raises(IncompatibleWorkerError) as err:
        reg.register(
            worker("m1", layout_fingerprint="f32", layout_text="KV int8, computed in float32")
        )
    assert "(KV int8, computed in float32)" in str(err.value)
    assert "(KV int8, computed in bfloat16)" in str(err.value)
    # A caller that does not describe its layout keeps the text another one left.
    reg.register(worker("m2"))
    with pytest.raises(IncompatibleWorkerError, match=r"computed in bfloat16"):
        reg.register(worker("m1", layout_fingerprint="f32"))


def test_pinned_identity_refuses_even_the_first_worker(client: redis.Redis, namespace: str) -> None:
    reg = make(client, namespace, model=MODEL, layout="pinned")
    with pytest.raises(IncompatibleWorkerError, match="configured for 'pinned'"):
        reg.register(worker("m0"))
    assert reg.list() == []


def test_expired_worker_disappears_and_heartbeat_recreates_it(
    client: redis.Redis, namespace: str
) -> None:
    reg = make(client, namespace, ttl_s=0.05)
    reg.register(worker("m0"))
    time.sleep(0.1)  # only a lower bound: any delay past the TTL is fine
    assert reg.list() == []
    assert reg.identity() is None  # identity lives exactly as long as the longest lease
    # The heartbeat that recreates it leases for longer than any scheduling stall.
    lasting = make(client, namespace, ttl_s=30)
    assert lasting.heartbeat(worker("m0")) is True
    assert [w.worker_id for w in lasting.list()] == ["m0"]


def test_draining_is_sticky_until_cleared(client: redis.Redis, namespace: str) -> None:
    reg = make(client, namespace)
    reg.register(worker("m0"))
    assert reg.set_draining("m0") is True
    reg.heartbeat(worker("m0"))  # the worker's own heartbeat must not un-drain it
    assert reg.list()[0].draining is True
    reg.set_draining("m0", False)
    assert reg.list()[0].draining is False
    assert reg.set_draining("ghost") is False
    assert reg.list()[0].worker_id == "m0"


def test_keep_registered_heartbeats_until_stopped(client: redis.Redis, namespace: str) -> None:
    # 50 heartbeats per TTL: only a stall of a whole second could let it lapse.
    ttl_s, interval_s = 1.0, 0.02
    reg = make(client, namespace, ttl_s=ttl_s)

    async def run() -> float:
        stop = asyncio.Event()
        info = worker("m0")
        task = asyncio.create_task(keep_registered(reg, lambda: info, stop, interval_s=interval_s))
        start = time.monotonic()
        while time.monotonic() - start < 2.5 * ttl_s:  # well past the TTL: only
            await asyncio.sleep(0.1)  # heartbeats keep it alive, and at every look
            assert [w.worker_id for w in await asyncio.to_thread(reg.list)] == ["m0"]
        stop.set()
        await asyncio.wait_for(task, 5.0)
        return time.monotonic()

    stopped = asyncio.run(run())
    assert reg.list(), "stopping must not deregister: the registration lapses by itself"
    while reg.list():  # no heartbeat after the stop
        assert time.monotonic() - stopped < ttl_s + 5.0, "still registered long after its TTL"
        time.sleep(0.05)


def test_the_same_process_under_a_new_role_moves_pools(client: redis.Redis, namespace: str) -> None:
    """A home-role change: the same id and incarnation re-registered under another role
    leaves its old pool in the same call (draining and the lease kept); another process
    with that id under another role is still refused."""
    reg = make(client, namespace, ttl_s=30)
    reg.register(worker("p0", "prefill", incarnation="a1"))
    reg.set_draining("p0")
    assert reg.register(worker("p0", "decode", incarnation="a1")) is False  # not new
    assert [(w.worker_id, w.role, w.draining) for w in reg.list()] == [("p0", "decode", True)]
    assert reg.list("prefill") == []
    keys = Keyspace(namespace)
    assert not client.sismember(keys.pool("prefill"), "p0")
    assert client.sismember(keys.pool("decode"), "p0")
    with pytest.raises(IncompatibleWorkerError, match="already registered as a decode worker"):
        reg.register(worker("p0", "prefill", incarnation="b2"))
    assert [w.role for w in reg.list()] == ["decode"]


def test_one_role_change_per_window_in_the_cluster(client: redis.Redis, namespace: str) -> None:
    reg = make(client, namespace)
    assert reg.claim_role_change("d0", 0.3) is True
    assert reg.claim_role_change("d1", 0.3) is False
    assert reg.claim_role_change("d0", 0.3) is False  # a window of its own too
    time.sleep(0.4)
    assert reg.claim_role_change("d1", 0.3) is True
