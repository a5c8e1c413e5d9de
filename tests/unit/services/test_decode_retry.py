"""`DecodeRetry`, the gateway's rules for a decode worker that refused a request before
its first chunk: which workers to exclude, when a full one may be tried again, and the
window (first-token deadline, KV lease) after which no attempt starts."""

from __future__ import annotations

import grpc

from pdserve.v1 import common_pb2
from services.gateway.stream.decode_retry import (
    BACKOFF_S,
    LEASE_MARGIN_S,
    REFUSALS,
    DecodeRefusal,
    DecodeRetry,
)

NOW, WALL = 100.0, 1_700_000_000.0


def handle(lease_left_s: float) -> common_pb2.KvHandle:
    return common_pb2.KvHandle(lease_expiry_unix_ms=int((WALL + lease_left_s) * 1000))


def test_only_full_and_unreachable_are_refusals() -> None:
    assert REFUSALS == {
        grpc.StatusCode.RESOURCE_EXHAUSTED: DecodeRefusal.FULL,
        grpc.StatusCode.UNAVAILABLE: DecodeRefusal.GONE,
    }


def test_the_window_is_the_first_token_deadline_for_a_long_lease() -> None:
    retry = DecodeRetry.start(10.0, handle(60.0), NOW, WALL)
    assert retry.first_token_deadline == retry.retry_until == NOW + 10.0
    assert retry.open(NOW + 9.9) and not retry.open(NOW + 10.0)
    assert retry.window_message("x").startswith("first_token_timeout_s: ")
    assert retry.window_message("x").endswith("within 10s (last: x)")


def test_the_window_closes_before_the_kv_lease_runs_out() -> None:
    retry = DecodeRetry.start(10.0, handle(5.0), NOW, WALL)
    assert retry.first_token_deadline == NOW + 10.0
    assert retry.retry_until == NOW + 5.0 - LEASE_MARGIN_S
    assert retry.window_message("x").startswith("kv_lease_ttl_s: ")


def test_a_mixed_request_has_no_lease_bound() -> None:
    retry = DecodeRetry.start(10.0, None, NOW, WALL)
    assert retry.retry_until == NOW + 10.0


def test_full_workers_are_tried_again_each_round_unreachable_ones_never() -> None:
    retry = DecodeRetry.start(10.0, None, NOW, WALL)
    assert retry.exclude() == [] and not retry.can_wait()
    retry.refused("d1", DecodeRefusal.FULL)
    retry.refused("d0", DecodeRefusal.GONE)
    assert retry.exclude() == ["d0", "d1"] and retry.can_wait() and retry.attempts == 3
    retry.retry_full()  # a new round: the full worker may have room now
    assert retry.exclude() == ["d0"] and not retry.can_wait()


def test_the_backoff_never_outlasts_the_window() -> None:
    retry = DecodeRetry.start(10.0, None, NOW, WALL)
    assert retry.backoff(NOW) == BACKOFF_S
    assert retry.backoff(NOW + 10.0 - BACKOFF_S / 2) == BACKOFF_S / 2
    assert retry.backoff(NOW + 11.0) == 0.0
