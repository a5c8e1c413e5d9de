"""Per-tenant tokens-per-minute quotas, kept in Redis so all gateway replicas share them.

Lifecycle of one request's charge: after authentication and tokenization the gateway
calls `admit(tenant, limit, prompt_tokens, max_tokens)`. `token_quota.lua` charges
prompt + max_tokens to the tenant's current one-minute window (Redis server time) while
that window is below the limit, or refuses with the time left in the window, which
becomes the caller's retry hint (`QuotaExceeded`). When the request ends, however it
ends, `settle(grant, completion_tokens)` refunds what the request did not generate, so
the window counts the tokens actually used.

Fail-open: if Redis is unreachable the request is admitted uncharged, the outage is
logged once and counted in `fail_open`; quotas resume with Redis. Serving beats
metering when the meter is down.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from importlib import resources

import redis

from services.common.status import QuotaExceeded as QuotaExceeded  # raised by admit
from services.router.redis_client import REDIS_DOWN_ERRORS

log = logging.getLogger(__name__)
WINDOW_MS = 60_000


@dataclass(frozen=True)
class Grant:
    """An admitted request's charge; `window_key` empty when nothing was charged."""

    window_key: str = ""
    charged: int = 0
    prompt_tokens: int = 0


def _script(name: str) -> str:
    return resources.files("services.gateway.access").joinpath(name).read_text(encoding="utf-8")


class TokenQuota:
    """Thread-safe; the gateway calls it from worker threads (redis-py is synchronous)."""

    def __init__(self, client: redis.Redis, namespace: str, window_ms: int = WINDOW_MS) -> None:
        self.client = client
        self.namespace = namespace
        self.window_ms = window_ms
        self._charge = client.register_script(_script("token_quota.lua"))
        self._refund = client.register_script(_script("token_refund.lua"))
        self._lock = threading.Lock()
        self._down = False
        self.fail_open = 0  # requests admitted uncharged because Redis was unreachable

    def key(self, tenant: str) -> str:
        return f"{self.namespace}:quota:{tenant}"

    def admit(self, tenant: str, limit: int, prompt_tokens: int, max_tokens: int) -> Grant:
        """Charge the request or raise QuotaExceeded; `limit` <= 0 means unlimited."""
        if limit <= 0:
            return Grant()
        charge = prompt_tokens + max_tokens
        try:
            ok, _, window, left_ms = self._charge(
                keys=[self.key(tenant)], args=[limit, charge, self.window_ms]
            )
        except REDIS_DOWN_ERRORS as exc:
            self._failed(exc)
            return Grant()
        self._recovered()
        if not int(ok):
            raise QuotaExceeded(tenant, limit, int(left_ms) / 1000)
        return Grant(f"{self.key(tenant)}:{int(window)}", charge, prompt_tokens)

    def settle(self, grant: Grant, completion_tokens: int, served: bool = True) -> None:
        """Refund what the request did not generate (and its prompt too when it was
        never `served`: refused by admission control before any worker saw it). Never
        raises: a lost refund only over-counts one window, which expires."""
        used = (grant.prompt_tokens if served else 0) + completion_tokens
        unused = grant.charged - used
        if not grant.window_key or unused <= 0:
            return
        try:
            self._refund(keys=[grant.window_key], args=[unused])
        except REDIS_DOWN_ERRORS as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self.fail_open += 1
            first, self._down = not self._down, True
        if first:
            log.warning("Redis unreachable (%s): token quotas fail open until it returns", exc)

    def _recovered(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            log.warning("Redis reachable again: token quotas resume")
