"""Fair shares across two gateway replicas, through real processes on 127.0.0.1.

One cluster: 1 prefill + 1 decode worker, embedded Redis, two gateways sharing both.
Tenant `heavy` sends its traffic through both gateways, tenant `light` only through the
second, both with more requests than the cluster serves, of one class and one size. A
gateway alone would hand `heavy` the first gateway's whole admission and half of the
second's; the ledger in Redis (attained KV-block-seconds per tenant, shared by both)
holds `heavy` back on the first gateway while `light` waits on the second, so the two
tenants get about equal service. Checked on the ledger itself (what each tenant held,
read through the window) and on the requests served; the leak probe ends the test.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from engine.model_store import DEFAULT_MODEL_NAME
from engine.priority import Priority
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.gateway.flow.fair_share import FairShare, FairView
from services.router.redis_client import connect
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.prompts import PARAGRAPH

KEYS = {"heavy": "heavy-tenant-key-00000001", "light": "light-tenant-key-00000002"}
CONTEST_S = 40.0  # how long both tenants stay backlogged
WARM_UP_S = 10.0  # served before this are not counted: the first burst is first-come
# Short answers: prefill is what binds, so admission, and with it the waiting room's
# order, decides who is served. A short budget keeps the admitted queue short (the
# first burst, admitted before the ledger has anything, drains quickly); requests
# waiting past it are refused, and the clients just send the next one.
BUDGET_S = 4
PROMPT = PARAGRAPH * 2
LEDGER_EVERY_S = 2.0  # the ledger is read this often through the counted window


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    cfg = ClusterConfig(
        gateway_port=0, model_cache_dir=MODEL_CACHE, worker_kv_cache_bytes=96 << 20,
        api_keys_file=str(keys), gateways=2,
        gateway_args=f"--ttft-budget-standard-s {BUDGET_S} --fair-share-half-life-s 10",
    )  # fmt: skip
    c = LocalCluster(cfg)
    c.start()
    yield c
    c.stop()


async def _client(session: aiohttp.ClientSession, http: str, tenant: str, i: int,
                  served: Counter[str], count_from: float, stop_at: float) -> None:  # fmt: skip
    """Send one request after another until `stop_at`; count the ones served between
    `count_from` and `stop_at`."""
    url = f"http://{http}/v1/completions"
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    n = 0
    while time.monotonic() < stop_at:
        body = {"model": DEFAULT_MODEL_NAME, "prompt": f"{tenant} {i} {n} {PROMPT}",
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        async with session.post(url, json=body, headers=headers) as resp:
            await resp.read()
            if resp.status == 200 and count_from < time.monotonic() < stop_at:
                served[tenant] += 1
        n += 1


async def _ledger_readings(cluster: LocalCluster, start: float, end: float) -> list[FairView]:
    """The shared ledger every `LEDGER_EVERY_S` from `start` to `end` (monotonic)."""
    assert cluster.redis is not None
    fair = FairShare(connect(cluster.redis.url, 2.0), "pdserve")
    readings = []
    at = start
    while at <= end:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        readings.append(await asyncio.to_thread(fair.sync, {}, {}))
        at += LEDGER_EVERY_S
    return readings


async def _contest(cluster: LocalCluster) -> tuple[Counter[str], list[FairView]]:
    """The requests each tenant had served in the window, and the ledger through it."""
    first, second = cluster.http_addresses
    served: Counter[str] = Counter()
    count_from = time.monotonic() + WARM_UP_S
    stop_at = time.monotonic() + CONTEST_S
    timeout = aiohttp.ClientTimeout(total=CONTEST_S + BUDGET_S + 30)
    # Read through the window, while both tenants are backlogged: one reading of the
    # decaying totals weighs the last few requests most (on a slow host a handful), and
    # after the window the clients stop and the tenants' queues drain unheld.
    ledger = asyncio.create_task(_ledger_readings(cluster, count_from, stop_at))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        window = (count_from, stop_at)
        clients = [_client(session, first, "heavy", i, served, *window) for i in range(8)]
        clients += [_client(session, second, "heavy", 8 + i, served, *window) for i in range(8)]
        clients += [_client(session, second, "light", i, served, *window) for i in range(8)]
        await asyncio.gather(*clients)
    return served, await ledger


def test_two_gateways_splitting_a_tenant_do_not_give_it_twice_its_share(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)
    served, readings = asyncio.run(_contest(cluster))
    standard = [r.classes[Priority.STANDARD] for r in readings]
    heavy = sum(a["heavy"].attained for a in standard if "heavy" in a)
    light = sum(a["light"].attained for a in standard if "light" in a)
    # Without the shared ledger heavy gets about 3x light (all of gateway 1, half of
    # gateway 2); with it, about the same.
    assert light > 0 and heavy / light < 1.6, (heavy, light, served)
    assert served["light"] > 0 and served["heavy"] / served["light"] < 2.0, (standard, served)
    assert_cluster_clean(probe)
