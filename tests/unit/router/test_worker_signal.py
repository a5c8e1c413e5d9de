"""Worker load signals on a real embedded Redis: a round trip keeps every field, a signal
expires after its TTL and goes at once when withdrawn, reads are filtered by pool, and
the age comes from Redis's clock."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis

from engine.stats import ClassCounts
from services.common.role import Role
from services.router.keyspace import Keyspace
from services.router.registry import Registry
from services.router.worker_signal import SignalBoard, WorkerSignal
from tests.unit.router.conftest import worker


def signal(worker_id: str, role: Role = Role.PREFILL, **kw: object) -> WorkerSignal:
    fields: dict[str, object] = dict(
        waiting_tokens=ClassCounts(sheddable=300, standard=120, critical=7), waiting=4,
        running=3, free_blocks=250, total_blocks=1000, block_size=16,
        prefill_tokens_per_s=5123.25, decode_step_s=0.0213,
    )  # fmt: skip
    fields.update(kw)
    return WorkerSignal(worker_id, role, **fields)  # type: ignore[arg-type]


def board(client: redis.Redis, namespace: str, *roles: tuple[str, Role],
          ttl_s: float = 30.0) -> SignalBoard:  # fmt: skip
    """A board on `namespace` with the given (worker id, role) pairs registered."""
    registry = Registry(client, Keyspace(namespace), ttl_s=30.0)
    for worker_id, role in roles:
        registry.register(worker(worker_id, role))
    return SignalBoard(client, Keyspace(namespace), ttl_s=ttl_s)


def test_a_signal_reads_back_exactly(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL))
    sent = signal("p0")
    b.publish(sent)
    (got,) = b.read([Role.PREFILL])
    assert dataclasses.replace(got, age_s=0.0) == sent
    assert 0.0 <= got.age_s < 5.0
    assert got.kv_utilisation == pytest.approx(0.75)
    assert client.pttl(Keyspace(namespace).signal("p0")) > 0


def test_the_decode_curve_reads_back_and_a_bad_one_drops_the_worker(
    client: redis.Redis, namespace: str
) -> None:
    b = board(client, namespace, ("d0", Role.DECODE), ("d1", Role.DECODE))
    sent = signal("d0", Role.DECODE, decode_curve=((1.0, 0.0123), (3.6, 0.0219)))
    b.publish(sent)
    b.publish(signal("d1", Role.DECODE))  # nothing decoded yet: an empty curve
    got = {s.worker_id: s for s in b.read([Role.DECODE])}
    assert got["d0"].decode_curve == sent.decode_curve and got["d1"].decode_curve == ()
    client.hset(Keyspace(namespace).signal("d1"), "decode_curve", "1.0;0.02")
    assert [s.worker_id for s in b.read([Role.DECODE])] == ["d0"]
    client.hdel(Keyspace(namespace).signal("d1"), "decode_curve")  # an older publisher's
    assert {s.worker_id: s.decode_curve for s in b.read([Role.DECODE])}["d1"] == ()


def test_a_republish_replaces_the_signal(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL))
    b.publish(signal("p0", waiting=9))
    b.publish(signal("p0", waiting=2, prefill_tokens_per_s=0.0))
    (got,) = b.read([Role.PREFILL])
    assert (got.waiting, got.prefill_tokens_per_s) == (2, 0.0)


def test_read_keeps_only_the_asked_pools(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL), ("d0", Role.DECODE), ("m0", Role.MIXED))
    for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("m0", Role.MIXED)):
        b.publish(signal(wid, role))
    b.publish(signal("stranger", Role.PREFILL))  # published but never registered
    assert [s.worker_id for s in b.read([Role.PREFILL])] == ["p0"]
    assert [s.worker_id for s in b.read([Role.DECODE, Role.MIXED])] == ["d0", "m0"]
    assert [(s.worker_id, s.role) for s in b.read(tuple(Role))] == [
        ("d0", Role.DECODE), ("m0", Role.MIXED), ("p0", Role.PREFILL)
    ]  # fmt: skip
    assert b.read([]) == []


def test_registered_without_a_signal_is_absent(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL), ("p1", Role.PREFILL))
    b.publish(signal("p1"))
    assert [s.worker_id for s in b.read([Role.PREFILL])] == ["p1"]


def test_withdraw_removes_it_at_once(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("d0", Role.DECODE))
    b.publish(signal("d0", Role.DECODE))
    b.withdraw("d0")
    assert b.read([Role.DECODE]) == []
    b.withdraw("d0")  # a second withdraw is a no-op


def test_a_signal_expires_after_its_ttl(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL), ttl_s=0.2)
    b.publish(signal("p0"))
    assert 0 < client.pttl(Keyspace(namespace).signal("p0")) <= 200
    deadline = time.monotonic() + 5.0  # generous: the host is shared
    while b.read([Role.PREFILL]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.read([Role.PREFILL]) == []
    assert not client.exists(Keyspace(namespace).signal("p0"))


def test_age_grows_from_the_publish(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL))
    b.publish(signal("p0"))
    time.sleep(0.2)
    (older,) = b.read([Role.PREFILL])
    assert 0.2 <= older.age_s < 5.0
    b.publish(signal("p0"))
    (fresh,) = b.read([Role.PREFILL])
    assert fresh.age_s < older.age_s


def test_a_foreign_hash_is_skipped_not_fatal(client: redis.Redis, namespace: str) -> None:
    b = board(client, namespace, ("p0", Role.PREFILL), ("p1", Role.PREFILL))
    b.publish(signal("p1"))
    client.hset(Keyspace(namespace).signal("p0"), mapping={"role": "prefill", "waiting": "x"})
    assert [s.worker_id for s in b.read([Role.PREFILL])] == ["p1"]


def test_bad_arguments_are_refused(client: redis.Redis, namespace: str) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        SignalBoard(client, Keyspace(namespace), ttl_s=0)
    with pytest.raises(ValueError, match="role"):
        signal("p0", role="chef")  # type: ignore[arg-type]
    assert signal("p0", free_blocks=0, total_blocks=0).kv_utilisation == 0.0
