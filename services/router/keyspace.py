"""Names of the Redis keys one pdserve cluster uses, all under one namespace prefix.

Layout (`ns` = namespace, `role` in prefill / decode / mixed):

- `ns:worker:<id>`   HASH of one worker's registration, PX-expiring (its heartbeat lease)
- `ns:pool:<role>`   SET of worker ids registered in a pool (pruned of expired ids)
- `ns:identity`      HASH {model, layout, layout_text} every live worker shares, PX-expiring
- `ns:load:<role>`   ZSET of load lease ids scored by expiry (Redis server ms)
- `ns:count:<role>`  HASH worker id -> number of live load leases (kept equal to the ZSET)
- `ns:expired:<role>` counter of load leases purged because they expired unreleased (a
  holder that died, or a release that never came: what a leak check looks for)
- `ns:rr:<role>`     round-robin counter
- `ns:cache:<role>:<id>`   ZSET prefix key -> last use: the router's model of one worker's
  prefix cache (policy `bounded`), PX-expiring when idle
- `ns:cachew:<role>:<id>`  HASH prefix key -> weight in blocks, `~used` -> their sum
- `ns:cacheseq:<role>`     counter ordering cache-model uses
- `ns:epoch`         random token; a change means Redis lost its data (restart, flush)
- `ns:signal:<id>`   HASH of one worker's live load signal (queued prefill tokens by
  class, requests, KV blocks, recent speeds, publish time), PX-expiring: a worker
  republishes it every `--signal-interval-s` (`worker_signal.py`)
- `ns:resident:<id>` SET of the prefix block hashes (16 hex digits) one worker holds,
  pool and offload tier, plus `~<incarnation>` naming the process that reported them;
  fed by the worker every `--signal-interval-s`, PX-expiring (`residency.py`)
- `ns:reconcile:<replid>:<role>`  after a failover to the primary with replication id
  `replid`: when a router first saw it (server ms), then "done" once the pool's inherited
  load leases were trimmed to the workers' own counts (`reconcile_load.lua`); 1 h TTL
- `ns:role_change`   id of the worker whose home role changed last, PX-expiring after
  one role window: at most one change per window in the cluster (`home_role.py`)

A load lease id is `<role>:<token>:<worker id>`: it names its pool and worker, so release
and expiry need no lookup. Tokens are hex, roles have no ':', so the split is unambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.model_config import check_model_name
from services.common.role import Role


@dataclass(frozen=True)
class Keyspace:
    namespace: str = "pdserve"

    def worker(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def worker_prefix(self) -> str:
        return f"{self.namespace}:worker:"

    def pool(self, role: str) -> str:
        return f"{self.namespace}:pool:{role}"

    @property
    def identity(self) -> str:
        return f"{self.namespace}:identity"

    def load(self, role: str) -> str:
        return f"{self.namespace}:load:{role}"

    def count(self, role: str) -> str:
        return f"{self.namespace}:count:{role}"

    def expired(self, role: str) -> str:
        return f"{self.namespace}:expired:{role}"

    def round_robin(self, role: str) -> str:
        return f"{self.namespace}:rr:{role}"

    def cache_lru(self, role: str, worker_id: str) -> str:
        return f"{self.namespace}:cache:{role}:{worker_id}"

    def cache_weights(self, role: str, worker_id: str) -> str:
        return f"{self.namespace}:cachew:{role}:{worker_id}"

    def cache_seq(self, role: str) -> str:
        return f"{self.namespace}:cacheseq:{role}"

    @property
    def epoch(self) -> str:
        return f"{self.namespace}:epoch"

    def signal(self, worker_id: str) -> str:
        return f"{self.namespace}:signal:{worker_id}"

    @property
    def signal_prefix(self) -> str:
        return f"{self.namespace}:signal:"

    def resident(self, worker_id: str) -> str:
        return f"{self.namespace}:resident:{worker_id}"

    def reconcile(self, replid: str, role: str) -> str:
        return f"{self.namespace}:reconcile:{replid}:{role}"

    @property
    def role_change(self) -> str:
        return f"{self.namespace}:role_change"


def pool_namespace(namespace: str, served_model_name: str = "", version: str = "") -> str:
    """The namespace one served model's workers register and are placed in: `namespace`
    itself for the unnamed model (a single-model cluster, as before models had names),
    else `namespace/name`, or `namespace/name@version` for a version of it. Each has its
    own registry, pools, load, cache model and signals, so models never share a worker
    or a placement; tenants' quotas and fair shares stay on `namespace`."""
    check_model_name(served_model_name, "served_model_name")
    check_model_name(version, "model_version")
    if not served_model_name:
        if version:
            raise ValueError("model_version needs served_model_name (a version of what?)")
        return namespace
    return f"{namespace}/{served_model_name}" + (f"@{version}" if version else "")


def lease_id(role: str, token: str, worker_id: str) -> str:
    return f"{role}:{token}:{worker_id}"


def parse_lease_id(lease: str) -> tuple[str, str, str]:
    """(role, token, worker id) of a lease id; ValueError if it is not one."""
    role, sep1, rest = lease.partition(":")
    token, sep2, worker_id = rest.partition(":")
    if not (sep1 and sep2 and Role.is_role(role) and token and worker_id):
        raise ValueError(f"not a pdserve load lease id: {lease!r}")
    return role, token, worker_id
