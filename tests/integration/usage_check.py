"""Reading a test cluster's usage ledger: each request's entry, by request id, once the
gateway's writer has stored it."""

from __future__ import annotations

import time
from collections.abc import Iterable

from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.gateway.access.usage_ledger import UsageEntry, UsageOutcome, read
from services.router.redis_client import connect

WRITE_WAIT_S = 10.0  # the writer flushes every 0.5 s; a cleanup may still be running


def ledger_entries(cluster: LocalCluster, request_ids: Iterable[str]) -> dict[str, UsageEntry]:
    """The ledger entry of each of `request_ids`; fails when one is missing after
    `WRITE_WAIT_S` or when a request has two."""
    assert cluster.redis is not None, "the ledger lives in the cluster's Redis"
    wanted = set(request_ids)
    client = connect(cluster.redis.url, 2.0)
    deadline = time.monotonic() + WRITE_WAIT_S
    try:
        while True:
            found = [e for e in read(client, "pdserve") if e.request_id in wanted]
            by_id = {e.request_id: e for e in found}
            assert len(by_id) == len(found), f"a request has two entries: {found}"
            if set(by_id) == wanted:
                return by_id
            assert time.monotonic() < deadline, f"no ledger entry for {wanted - set(by_id)}"
            time.sleep(0.1)
    finally:
        client.close()


def assert_ledger_matches(
    cluster: LocalCluster, finals: Iterable[gateway_pb2.GenerateResponse]
) -> None:
    """Each finished request's ledger entry holds exactly the usage its last message
    carried (so the ledger's sums are the responses' sums)."""
    finals = list(finals)
    assert all(m.finished and m.usage.prompt_tokens for m in finals), finals
    entries = ledger_entries(cluster, (m.request_id for m in finals))
    for msg in finals:
        e = entries[msg.request_id]
        got = (e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.outcome)
        u = msg.usage
        want = (u.prompt_tokens, u.cached_tokens, u.completion_tokens, UsageOutcome.FINISHED)
        assert got == want, (msg.request_id, got, want)
