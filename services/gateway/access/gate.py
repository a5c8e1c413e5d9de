"""The gateway's access gate: who is calling (API keys) and how much they may use (quotas).

Lifecycle: `Access.from_config(config, redis_client)` is built once at start: with no
keys file every caller is the anonymous tenant "" and nothing is metered, which suits a
single team on a private network. Per call, both front doors run
`authenticate(headers)` → `Principal`, then the request's record
(`services.gateway.stream.request_record`) runs `admit(principal, prompt_tokens, max_tokens)`
before routing and `settle(grant, completion_tokens)` when the request ends, however it
ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable

import redis

from services.common.detached import done, in_thread
from services.gateway.access.auth import ANONYMOUS, ApiKeys, Principal, key_from_headers
from services.gateway.access.quota import Grant, TokenQuota
from services.gateway.config import GatewayConfig

NO_GRANT = Grant()


class Access:
    def __init__(
        self, keys: ApiKeys | None, quota: TokenQuota | None, default_tpm: int = 0
    ) -> None:
        self.keys = keys
        self.quota = quota
        self.default_tpm = default_tpm

    @classmethod
    def open(cls) -> Access:
        """No keys, no quotas: every caller is the anonymous tenant."""
        return cls(None, None)

    @classmethod
    def from_config(
        cls, config: GatewayConfig, client: redis.Redis | None, namespace: str
    ) -> Access:
        keys = ApiKeys.from_file(config.api_keys_file) if config.api_keys_file else None
        metered = config.tokens_per_minute > 0 or (keys is not None and keys.any_quota())
        if metered and client is None:
            raise ValueError(
                "tokens_per_minute: quotas are kept in Redis; give --redis-url "
                "(or --placement redis)"
            )
        quota = TokenQuota(client, namespace) if metered and client is not None else None
        return cls(keys, quota, config.tokens_per_minute)

    def authenticate(self, headers: Iterable[tuple[str, str | bytes]]) -> Principal:
        """The caller's principal; raises AuthError (UNAUTHENTICATED / 401)."""
        if self.keys is None:
            return ANONYMOUS
        return self.keys.authenticate(key_from_headers(headers))

    def limit(self, principal: Principal) -> int:
        return principal.tokens_per_minute or self.default_tpm

    def admit(
        self, principal: Principal, prompt_tokens: int, max_tokens: int
    ) -> asyncio.Future[Grant]:
        """Start charging the tenant's quota now; the future is the grant, or raises
        QuotaExceeded (RESOURCE_EXHAUSTED / 429). The Redis call is handed to a thread at
        call time and keeps going if an await of the future is cancelled: whoever holds
        the future owns the charge and must `settle` it (see `RequestRecord`)."""
        limit = self.limit(principal)
        loop = asyncio.get_running_loop()
        if self.quota is None or limit <= 0:
            free: asyncio.Future[Grant] = loop.create_future()
            free.set_result(NO_GRANT)
            return free
        return loop.run_in_executor(
            None, self.quota.admit, principal.tenant, limit, prompt_tokens, max_tokens
        )

    def settle(self, grant: Grant, completion_tokens: int, served: bool = True) -> Awaitable[None]:
        """Refund what the request did not use. Like a load release, the Redis call is
        handed to a thread when this is called, and cancelling the caller (a stream torn
        down while it cleans up) never drops it: the tenant would be charged for
        `max_tokens` it never got."""
        if self.quota is None or not grant.window_key:
            return done()
        return in_thread(self.quota.settle, grant, completion_tokens, served)
