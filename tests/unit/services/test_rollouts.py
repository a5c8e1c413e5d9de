"""Rollouts through the gateway, on real Redis and routers in front of fake workers: a
named model's canary version takes its share of requests on its own workers; a canary
whose requests fail is rolled back automatically and the stable version takes
everything again; promote moves every new request to the new version and drains the
old one's workers, while a request already running there finishes; the admin API
refuses what it cannot do. Nothing is held afterwards in any version's pools."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import gateway_pb2
from services.common.status import NoRolloutsError, RolloutConflict
from services.gateway.access.auth import ApiKeys
from services.gateway.access.gate import Access
from services.gateway.client import RequestOptions, build_request
from services.gateway.flow.admission import Admission
from services.gateway.models.backend import Backend
from services.gateway.models.rollout_admin import RolloutAdmin
from services.gateway.models.rollout_follower import RollbackPolicy, RolloutFollower
from services.gateway.stream.errors import StreamError
from services.gateway.stream.record_book import Resource
from services.router.keyspace import Keyspace, pool_namespace
from services.router.redis_placement import RedisPlacement
from services.router.registry import Registry, WorkerInfo
from services.router.rollout_store import RolloutPhase, RolloutStore
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests import binomial
from tests.binomial import ALPHA
from tests.unit.services.gateway_fakes import PROMPT, Gateway, build_gateway, until

MODEL = "m"  # what build_gateway names its model
POLICY = RollbackPolicy(window_s=60.0, min_requests=10, error_margin=0.05, latency_margin=0.5)
Action = gateway_pb2.RolloutAction


class Rollouts:
    """A gateway whose primary model is named `MODEL` (its workers in its pool), with the
    follower and admin `build_service` gives a named model; `add_version` registers a
    version's prefill and decode workers."""

    def __init__(self, client: redis.Redis, base: str, model_dir: Path) -> None:
        self.client = client
        self.base = base
        self.gw: Gateway = build_gateway(client, pool_namespace(base, MODEL), model_dir)
        self.routers: list[Router] = [self.gw.router]
        self.store = RolloutStore(client, base)
        model = self.gw.service.models.primary
        model.make_backend = self._backend
        model.follower = RolloutFollower(self.store, MODEL, POLICY, model.ensure_version)
        self.follower = model.follower
        self.gw.service.rollouts = RolloutAdmin(
            self.gw.service.models, self.store, base, drain_after_s=0.2
        )

    def _backend(self, version: str) -> Backend:
        router = Router(
            self.client, RouterConfig(namespace=pool_namespace(self.base, MODEL, version))
        )
        router.refresh()
        self.routers.append(router)
        return self.gw.service.parts.backend(
            version, RedisPlacement(router), Admission(self.gw.service.config)
        )

    def add_version(self, version: str) -> None:
        registry = Registry(self.client, Keyspace(pool_namespace(self.base, MODEL, version)))
        for role in ("prefill", "decode"):
            wid = f"{version}{role[0]}0"
            registry.register(WorkerInfo(wid, role, "m2", "l2", f"{wid}:1"))  # type: ignore[arg-type]

    async def act(
        self, action: int, version: str = "", weight: float = 0.0
    ) -> gateway_pb2.RolloutStatus:
        assert self.gw.service.rollouts is not None
        request = gateway_pb2.RolloutRequest(
            model=MODEL, action=action, version=version, weight=weight
        )  # type: ignore[arg-type]
        return await self.gw.service.rollouts.act(request)

    async def run(self, n: int) -> list[str]:
        """`n` requests one after another; the prefill worker each went to (or the error)."""
        out = []
        for _ in range(n):
            before = len(self.gw.cluster.prefills)
            request = build_request(PROMPT, RequestOptions(max_tokens=4, model=MODEL))
            try:
                async for _msg in self.gw.service.stream(self.gw.service.decode(request)):
                    pass
                out.append(self.gw.cluster.prefills[before])
            except StreamError as exc:
                out.append(exc.code.name)
        return out

    async def check_clean(self) -> None:
        await self.gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert self.gw.service.book.counts() == dict.fromkeys(Resource, 0)
        for router in self.routers:
            counts = {r: router.ledger.snapshot(r).counts for r in ("prefill", "decode")}
            assert counts == {"prefill": {}, "decode": {}}


@pytest.fixture
def rollouts(client: redis.Redis, namespace: str, model_dir: Path) -> Iterator[Rollouts]:
    r = Rollouts(client, namespace, model_dir)
    r.add_version("v2")
    yield r


def test_a_canary_takes_its_share_on_its_own_workers(rollouts: Rollouts) -> None:
    async def scenario() -> None:
        status = await rollouts.act(Action.ROLLOUT_ACTION_START, "v2", 0.1)
        assert (status.phase, status.canary, status.weight) == ("running", "v2", 0.1)
        # Exact binomial bounds at 10%: (72, 174) of 1200. A right split falls outside
        # them with probability 6.5e-7; a split of 20% lands inside with 4.7e-7, one of
        # 0% never does.
        n = 1200
        within = binomial.bounds(n, 0.1)
        assert binomial.accepts(n, 0.0, within) < ALPHA
        assert binomial.accepts(n, 0.2, within) < ALPHA
        went = await rollouts.run(n)
        assert set(went) == {"p0:1", "v2p0:1"}
        canary = went.count("v2p0:1")
        assert within[0] <= canary <= within[1], (canary, within)
        await asyncio.to_thread(rollouts.follower.tick)  # the outcomes go to Redis
        status = await rollouts.act(Action.ROLLOUT_ACTION_STATUS)
        assert status.canary_window.requests == canary and status.canary_window.errors == 0
        assert status.stable_window.requests == n - canary
        await rollouts.check_clean()

    asyncio.run(scenario())


def test_a_failing_canary_is_rolled_back(rollouts: Rollouts) -> None:
    async def scenario() -> None:
        rollouts.gw.cluster.broken.add("v2p0:1")
        await rollouts.act(Action.ROLLOUT_ACTION_START, "v2", 0.5)
        went = await rollouts.run(60)  # fewer than 10 of them to the canary: p < 1e-6
        assert "INTERNAL" in went and "p0:1" in went
        rolled = await asyncio.to_thread(rollouts.follower.tick)
        assert rolled.phase is RolloutPhase.ROLLED_BACK
        assert rolled.reason.startswith("automatic: error rate 100.0%")
        assert set(await rollouts.run(20)) == {"p0:1"}  # the stable version takes all
        await rollouts.check_clean()

    asyncio.run(scenario())


def test_promote_moves_new_requests_and_drains_the_old_version(rollouts: Rollouts) -> None:
    async def scenario() -> None:
        gw = rollouts.gw
        gate = gw.cluster.gates["next_token"]
        gate.hold()
        running = asyncio.create_task(rollouts.run(1))  # on the stable version, held
        await asyncio.wait_for(gate.arrived.wait(), 10)
        await rollouts.act(Action.ROLLOUT_ACTION_START, "v2", 0.5)
        status = await rollouts.act(Action.ROLLOUT_ACTION_PROMOTE)
        assert (status.phase, status.stable) == ("promoted", "v2")
        old = Registry(rollouts.client, Keyspace(pool_namespace(rollouts.base, MODEL)))
        assert not any(w.draining for w in old.list())  # until every gateway follows
        await until(lambda: all(w.draining for w in old.list()), timeout=5.0)
        gate.proceed.set()
        assert await running == ["p0:1"]  # the running request finished where it was
        assert set(await rollouts.run(10)) == {"v2p0:1"}
        await rollouts.check_clean()

    asyncio.run(scenario())


def test_the_admin_api_refuses_what_it_cannot_do(rollouts: Rollouts) -> None:
    async def scenario() -> None:
        with pytest.raises(RolloutConflict, match="no rollout running"):
            await rollouts.act(Action.ROLLOUT_ACTION_PROMOTE)
        with pytest.raises(ValueError, match="weight must be in"):
            await rollouts.act(Action.ROLLOUT_ACTION_START, "v2", 1.5)
        with pytest.raises(ValueError, match="name one of"):
            await rollouts.act(Action.ROLLOUT_ACTION_UNSPECIFIED)
        rollouts.gw.service.models.primary.follower = None  # as for the unnamed model
        with pytest.raises(NoRolloutsError, match="no versions to roll out"):
            await rollouts.act(Action.ROLLOUT_ACTION_STATUS)

    asyncio.run(scenario())


class _Context:
    """The servicer context of a call made with `key`'s metadata."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),)

    async def abort(self, code: grpc.StatusCode, details: str, *_: object) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def test_the_rollout_rpc_needs_an_admin_key(rollouts: Rollouts, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("ops ops-key-0123456789 admin\nacme acme-key-0123456789\n")
    rollouts.gw.service.access = Access(ApiKeys.from_file(keys), None)
    request = gateway_pb2.RolloutRequest(model=MODEL, action=Action.ROLLOUT_ACTION_STATUS)

    async def scenario() -> None:
        denied = _Context("acme-key-0123456789")
        with pytest.raises(grpc.aio.AbortError):
            await rollouts.gw.service.Rollout(request, denied)  # type: ignore[arg-type]
        assert denied.aborted is not None
        assert denied.aborted[0] is grpc.StatusCode.PERMISSION_DENIED
        assert "Rollout needs an admin key" in denied.aborted[1]
        status = await rollouts.gw.service.Rollout(request, _Context("ops-key-0123456789"))  # type: ignore[arg-type]
        assert status.model == MODEL and status.phase == "none"

    asyncio.run(scenario())


# -- the Rollout RPC under any request ----------------------------------------------------
ADMIN_KEY = "ops-key-0123456789"
ROLLOUT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION}  # fmt: skip
PHASES = {p.value for p in RolloutPhase}
# Versions come from a short list: each one a START accepts gets a backend of its own.
ROLLOUT_REQUESTS = st.builds(
    gateway_pb2.RolloutRequest,
    # Half the requests name the served model, so the rollout's state moves.
    model=st.just(MODEL) | st.sampled_from(["", "nope", "m/../x", "m\\x00", "é" * 3, "x" * 300]),
    action=st.integers(min_value=-1, max_value=6),  # four actions, unspecified, unknown
    version=st.sampled_from(["v2", "v3", "", " ", "v2\x00", "v/../2", "x" * 300, MODEL]),
    weight=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.2, 0.5]),
    sticky=st.booleans(),
)


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(batch=st.lists(ROLLOUT_REQUESTS, min_size=1, max_size=5))
def test_any_rollout_request_ends_in_a_documented_status(
    rollouts: Rollouts, tmp_path: Path, batch: list[gateway_pb2.RolloutRequest]
) -> None:
    """Fuzz: any model, action (unknown ones too), version, weight (NaN, infinities) in
    any order, through the RPC with an admin key, answers a status or INVALID_ARGUMENT /
    NOT_FOUND / FAILED_PRECONDITION, never INTERNAL or an exception; and whatever
    happened, a running rollout is always a real split (a canary that is not the stable
    version, a weight in (0, 1)). State carries over between examples."""
    keys = tmp_path / "keys"
    keys.write_text(f"ops {ADMIN_KEY} admin\n")
    rollouts.gw.service.access = Access(ApiKeys.from_file(keys), None)

    async def scenario() -> None:
        for request in batch:
            context = _Context(ADMIN_KEY)
            try:
                status = await rollouts.gw.service.Rollout(request, context)  # type: ignore[arg-type]
            except grpc.aio.AbortError:
                assert context.aborted is not None and context.aborted[0] in ROLLOUT_CODES, (
                    request,
                    context.aborted,
                )
            else:
                assert status.model == MODEL and status.phase in PHASES, status
            current = rollouts.store.read(MODEL)
            if current.running:
                assert 0 < current.weight < 1 and current.canary not in ("", current.stable)

    asyncio.run(scenario())
