"""The worker registry in Redis: who serves which pool, with what model and KV layout.

Lifecycle of a registration: a worker calls `register` once it can serve (a PX-expiring
hash plus membership in its pool's set), then `heartbeat` well within `ttl_s` to renew
it. A heartbeat re-creates a registration Redis lost (restart, failover), so the registry
rebuilds itself from heartbeats. A worker whose calls fail can be marked down
(`mark_down`): every router skips it until the mark runs out, long before its lease
would. To leave, a worker calls `set_draining(id)` (routers stop
sending it requests), finishes its streams, then `deregister`s; a worker that dies just
stops heartbeating and expires. All workers must share one model and KV layout (the
cluster's identity): the first live worker sets it unless the config pins it, and a worker
that differs is refused at registration, not at its first KV transfer. A worker also
publishes its model's identity parts (`engine.model_identity`), so a gateway can name what
differs between its own copy of the model and the workers' (the tokenizer, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import redis

from engine.model_identity import ModelIdentity
from services.common.role import Role
from services.common.status import IncompatibleWorkerError as IncompatibleWorkerError
from services.router.keyspace import Keyspace
from services.router.redis_client import REDIS_DOWN_ERRORS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: Role
    model: str  # model fingerprint (ModelSpec.fingerprint)
    layout_fingerprint: str  # KV layout fingerprint (KvLayout.fingerprint())
    address: str  # host:port of the worker's gRPC server
    capacity: int = 0  # KV blocks it can hold (informational)
    draining: bool = False
    incarnation: str = ""  # its process's start token: a new one restarts its slow start
    identity: ModelIdentity | None = None  # the parts `model` folds (None: not published)
    adapters: tuple[str, ...] = ()  # LoRA adapters resident at its last heartbeat
    layout_text: str = ""  # its KV layout in words (KvLayout.describe()), for refusals

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")


class Registry:
    """Registrations of one cluster (namespace). Redis errors propagate to the caller.

    `model` / `layout` pin the identity every worker must have; empty means "whatever the
    first live worker has".
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keyspace,
        *,
        ttl_s: float = 10.0,
        model: str = "",
        layout: str = "",
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.model = model
        self.layout = layout
        text = resources.files("services.router").joinpath("registry.lua").read_text("utf-8")
        self._script = client.register_script(text)

    def _call(self, op: str, *args: str | int) -> object:
        keys = [self.keys.identity, *(self.keys.pool(r) for r in Role)]
        return self._script(keys=keys, args=[op, self.keys.worker_prefix, *args])

    def register(self, info: WorkerInfo) -> bool:
        """Create or renew `info`'s registration; True if it was created.

        Raises IncompatibleWorkerError (and registers nothing) if the worker's model or
        KV layout differs from the cluster's, or its id is registered under another role
        by another process (incarnation). The same incarnation under a new role moves the
        worker to that role's pool, atomically: its home role changed at run time.
        """
        self._check_pinned(info)
        res = self._call(
            "register", info.worker_id, info.role, info.model, info.layout_fingerprint,
            info.address, info.capacity, "1" if info.draining else "0",
            max(1, round(self.ttl_s * 1000)), info.incarnation, _identity_text(info.identity),
            ",".join(info.adapters), info.layout_text,
        )  # fmt: skip
        assert isinstance(res, list)
        status = str(res[0])
        if status == "identity":
            raise IncompatibleWorkerError(
                f"worker {info.worker_id!r} refused: it has model {info.model!r} and KV layout "
                f"{info.layout_fingerprint!r} ({info.layout_text or 'not described'}), but the "
                f"live workers have model {res[1]!r} and KV layout {res[2]!r} "
                f"({str(res[3]) if len(res) > 3 and res[3] else 'not described'}); start it "
                f"with the same model, dtype, KV cache dtype, kernels and block size, or in "
                f"another namespace"
            )
        if status == "role":
            raise IncompatibleWorkerError(
                f"worker {info.worker_id!r} refused: that id is already registered as a "
                f"{res[1]} worker; give each worker a unique id"
            )
        return int(res[1]) == 1

    def _check_pinned(self, info: WorkerInfo) -> None:
        for what, want, got in (
            ("model", self.model, info.model),
            ("KV layout", self.layout, info.layout_fingerprint),
        ):
            if want and got != want:
                raise IncompatibleWorkerError(
                    f"worker {info.worker_id!r} refused: its {what} is {got!r} but the router "
                    f"is configured for {want!r}"
                )

    def heartbeat(self, info: WorkerInfo) -> bool:
        """Renew the lease; True if the registration was lost and had to be re-created."""
        return self.register(info)

    def deregister(self, worker_id: str) -> bool:
        """Remove a worker; True if it was registered. Its load leases expire on their own."""
        return int(str(self._call("deregister", worker_id))) == 1

    def set_draining(self, worker_id: str, draining: bool = True) -> bool:
        """Mark a worker (un)draining; routers stop placing on it at once. False if unknown."""
        return int(str(self._call("drain", worker_id, "1" if draining else "0"))) == 1

    def mark_down(self, worker_id: str, seconds: float) -> bool:
        """Keep every router's placements off a worker for `seconds` (a call to it failed
        with UNAVAILABLE); a re-registration under a new incarnation lifts it. False if
        the worker is not registered."""
        ms = max(1, round(seconds * 1000))
        return int(str(self._call("down", worker_id, ms))) == 1

    def list(self, role: str | None = None) -> list[WorkerInfo]:
        """Live registrations (all pools, or one), pruning expired ones from the pool sets."""
        if role is not None:
            role = Role.parse(role)
        res = self._call("list", role or "")
        assert isinstance(res, list)
        flat = [str(x) for x in res]
        out = []
        for i in range(0, len(flat), 9):
            wid, r, model, layout, address, capacity, draining, identity, lora = flat[i : i + 9]
            info = WorkerInfo(
                wid, Role.parse(r), model, layout, address, int(capacity or 0),
                draining == "1", identity=_parse_identity(identity),
                adapters=tuple(a for a in lora.split(",") if a),
            )  # fmt: skip
            out.append(info)
        return sorted(out, key=lambda w: (w.role, w.worker_id))

    def claim_role_change(self, worker_id: str, seconds: float) -> bool:
        """Take the cluster's one home-role change for the next `seconds`; False if
        another worker (or this one) changed role within them. Spacing changes a window
        apart lets each one's effect show in the signals before the next is decided."""
        ms = max(1, round(seconds * 1000))
        return bool(self.client.set(self.keys.role_change, worker_id, nx=True, px=ms))

    def identity(self) -> tuple[str, str] | None:
        """(model, layout) of the live workers, or None if none is registered."""
        model, layout = self.client.hmget(self.keys.identity, ["model", "layout"])
        return None if model is None else (str(model), str(layout))


def _identity_text(identity: ModelIdentity | None) -> str:
    return "" if identity is None else json.dumps(identity.to_json(), sort_keys=True)


def _parse_identity(text: str) -> ModelIdentity | None:
    """A registration's identity; None if it has none or it does not parse (a worker of
    another version: the model fingerprint still guards KV and cache keys)."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    return ModelIdentity.from_json(raw) if isinstance(raw, dict) else None


async def keep_registered(
    registry: Registry,
    current: Callable[[], WorkerInfo],
    stop: asyncio.Event,
    interval_s: float | None = None,
    lock: asyncio.Lock | None = None,
) -> None:
    """Heartbeat `current()` every `interval_s` (default ttl/3) until `stop` is set
    (what changes between beats, such as the resident LoRA adapters, goes with each).

    Survives Redis outages (logged): the next heartbeat after Redis returns re-creates
    the registration. An IncompatibleWorkerError propagates: the worker must not serve.
    A beat holds `lock` (when given) from reading `current()` to Redis's reply, so a
    role change holding it too is never undone by a beat that read the old role.
    """
    interval = registry.ttl_s / 3 if interval_s is None else interval_s
    while not stop.is_set():
        async with lock or contextlib.nullcontext():
            info = current()
            try:
                if await asyncio.to_thread(registry.heartbeat, info):
                    log.info("worker %s (%s) registered with the router", info.worker_id,
                             info.role)  # fmt: skip
            except REDIS_DOWN_ERRORS as exc:
                log.warning("heartbeat of %s failed, Redis unreachable: %s", info.worker_id,
                            exc)  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
