"""The admin side of rollouts: the `Rollout` RPC's actions on a served model, and the
rollout part of ClusterStatus.

Lifecycle of one action (the caller is an admin; the RPC checks): resolve the model (a
named one: the unnamed model has no versions to roll out), change the rollout in Redis
(`RolloutStore`), and tick the model's follower at once so that this gateway acts on it
from its next request (the others follow within `rollout_refresh_s`). START first makes
sure the canary's backend exists (after checking the start, so a refused one makes
none). PROMOTE then drains the old stable version's workers in the registry, once every
gateway has had time to follow (`drain_after_s`: two rollout refreshes and a membership
refresh): routers stop placing there, the streams they run finish, and the workers stay
up, draining, for the operator to stop.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.v1 import gateway_pb2
from services.common.status import NoRolloutsError
from services.gateway.models.catalog import ModelCatalog
from services.gateway.models.rollout_follower import RolloutFollower, error_rate, itls, p90, ttfts
from services.gateway.models.served_model import ServedModel
from services.router.keyspace import Keyspace, pool_namespace
from services.router.registry import Registry
from services.router.rollout_store import Outcome, Rollout, RolloutStore, check_start

log = logging.getLogger(__name__)

Action = gateway_pb2.RolloutAction


class RolloutAdmin:
    def __init__(
        self, catalog: ModelCatalog, store: RolloutStore, namespace: str, drain_after_s: float
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.namespace = namespace
        self.drain_after_s = drain_after_s  # how long every gateway needs to follow
        self._drains: set[asyncio.Task[None]] = set()

    async def act(self, request: gateway_pb2.RolloutRequest) -> gateway_pb2.RolloutStatus:
        """Carry out `request`; raises UnknownModelError, NoRolloutsError, RolloutConflict
        (not in the phase the action needs) or ValueError (a bad weight or version)."""
        model = self.catalog.get(request.model or "")
        follower = self._follower(model)
        if request.action == Action.ROLLOUT_ACTION_START:
            await asyncio.to_thread(self._start, model, request)
        elif request.action == Action.ROLLOUT_ACTION_PROMOTE:
            old = await asyncio.to_thread(self.store.read, model.name)
            await asyncio.to_thread(self.store.promote, model.name)
            drain = asyncio.create_task(self._drain_later(model.name, old))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        elif request.action == Action.ROLLOUT_ACTION_ABORT:
            await asyncio.to_thread(self.store.abort, model.name)
        elif request.action != Action.ROLLOUT_ACTION_STATUS:
            raise ValueError("action: name one of status, start, promote, abort")
        rollout = await asyncio.to_thread(follower.tick)
        return await asyncio.to_thread(self.status, follower, rollout)

    def _follower(self, model: ServedModel) -> RolloutFollower:
        if model.follower is None:
            raise NoRolloutsError(
                f"model: {model.name!r} has no versions to roll out; serve it under a name "
                "(--served-model-name or --extra-models) with --placement redis"
            )
        return model.follower

    def _start(self, model: ServedModel, request: gateway_pb2.RolloutRequest) -> None:
        """Check the start before the canary's backend is made (a refused start makes
        none), then start (Redis I/O; the store checks again under its WATCH)."""
        check_start(self.store.read(model.name), request.version, request.weight)
        model.ensure_version(request.version)
        self.store.start(model.name, request.version, request.weight, sticky=request.sticky)

    async def _drain_later(self, model: str, old: Rollout) -> None:
        """Drain the old stable version once every gateway has followed the promote:
        until then some still send it their stable share."""
        await asyncio.sleep(self.drain_after_s)
        try:
            drained = await asyncio.to_thread(self._drain, model, old.stable)
        except Exception as exc:  # Redis away: the operator drains or stops them by hand
            log.warning("model %s: could not drain version %r: %s", model, old.stable, exc)
            return
        log.info(
            "model %s: %r promoted; %d workers of %r draining", model, old.canary, drained,
            old.stable,
        )  # fmt: skip

    async def close(self) -> None:
        """The gateway stops: drains still waiting are dropped (the operator drains or
        stops that version by hand)."""
        for task in list(self._drains):
            task.cancel()
        self._drains.clear()

    def _drain(self, model: str, version: str) -> int:
        """Mark every worker of `model`'s `version` draining; returns how many."""
        pool = Keyspace(pool_namespace(self.namespace, model, version))
        registry = Registry(self.store.client, pool)
        workers = registry.list()
        for w in workers:
            registry.set_draining(w.worker_id)
        return len(workers)

    def status(self, follower: RolloutFollower, rollout: Rollout) -> gateway_pb2.RolloutStatus:
        """`rollout` with both versions' windows (Redis I/O)."""
        reply = gateway_pb2.RolloutStatus(
            model=rollout.model, stable=rollout.stable, canary=rollout.canary,
            weight=rollout.weight, sticky=rollout.sticky, phase=rollout.phase.value,
            reason=rollout.reason, started_ms=rollout.started_ms,
        )  # fmt: skip
        if rollout.canary:
            stable, canary = follower.windows(rollout)
            reply.stable_window.CopyFrom(_window(stable))
            reply.canary_window.CopyFrom(_window(canary))
        return reply

    async def statuses(self) -> list[gateway_pb2.RolloutStatus]:
        """Every named model's rollout that ever started (for ClusterStatus)."""
        out = []
        for model in self.catalog:
            if model.follower is None:
                continue
            rollout = model.follower.rollout
            if rollout.started_ms:
                out.append(await asyncio.to_thread(self.status, model.follower, rollout))
        return out


def _window(outcomes: list[Outcome]) -> gateway_pb2.RolloutWindow:
    return gateway_pb2.RolloutWindow(
        requests=len(outcomes),
        errors=round(error_rate(outcomes) * len(outcomes)),
        ttft_p90_s=p90(ttfts(outcomes)),
        itl_p90_s=p90(itls(outcomes)),
    )
