"""The admin side of rollouts: the `Rollout` RPC's actions on a served model, and the
rollout part of ClusterStatus.

Lifecycle of one action (the caller is an admin; the RPC checks): resolve the model (a
named one: the unnamed model has no versions to roll out), change the rollout in Redis
(`RolloutStore`), and tick the model's follower at once so that this gateway acts on it
from its next request (the others follow within `rollout_refresh_s`). START first makes
sure the canary's backend exists. PROMOTE then drains the old stable version's workers
in the registry: routers stop placing there at once, the streams they run finish, and
the workers stay up for the operator to stop (or to roll back to by hand).
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.v1 import gateway_pb2
from services.common.status import NoRolloutsError
from services.gateway.rollout_follower import RolloutFollower, error_rate, itls, p90, ttfts
from services.gateway.served_model import ModelCatalog, ServedModel
from services.router.keyspace import Keyspace, pool_namespace
from services.router.registry import Registry
from services.router.rollout_store import Outcome, Rollout, RolloutStore

log = logging.getLogger(__name__)

Action = gateway_pb2.RolloutAction


class RolloutAdmin:
    def __init__(self, catalog: ModelCatalog, store: RolloutStore, namespace: str) -> None:
        self.catalog = catalog
        self.store = store
        self.namespace = namespace

    async def act(self, request: gateway_pb2.RolloutRequest) -> gateway_pb2.RolloutStatus:
        """Carry out `request`; raises UnknownModelError, NoRolloutsError, RolloutConflict
        (not in the phase the action needs) or ValueError (a bad weight or version)."""
        model = self.catalog.get(request.model or "")
        follower = self._follower(model)
        if request.action == Action.ROLLOUT_ACTION_START:
            await asyncio.to_thread(model.ensure_version, request.version)
            await asyncio.to_thread(
                self.store.start, model.name, request.version, request.weight,
                sticky=request.sticky,
            )  # fmt: skip
        elif request.action == Action.ROLLOUT_ACTION_PROMOTE:
            old = await asyncio.to_thread(self.store.read, model.name)
            await asyncio.to_thread(self.store.promote, model.name)
            drained = await asyncio.to_thread(self._drain, model.name, old.stable)
            log.info(
                "model %s: %r promoted; %d workers of %r draining", model.name, old.canary,
                drained, old.stable,
            )  # fmt: skip
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
