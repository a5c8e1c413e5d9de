"""API keys per tenant: who is calling, and what they may do.

Lifecycle: the gateway loads `ApiKeys.from_file(path)` once at start (a bad file stops
it with the line number). For every call, gRPC or HTTP, the front door pulls the key
from the `authorization: Bearer <key>` or `x-api-key: <key>` header (`key_from_headers`)
and `authenticate` turns it into a `Principal`: the tenant whose prefix-cache salt and
router keys the request gets, whether it may use admin calls, its token quota, and its
priority classes. The tenant comes only from the key: no request field can name another
tenant. A request's class comes from the request, up to the key's highest
(`Principal.priority_for`), or else the key's default.

Keys file, one key per line (`#` starts a comment):

    <tenant> <key> [admin] [tpm=<tokens per minute>] [class=<default class>]
                   [max_class=<highest class it may ask for>] [weight=<fair share, > 0>]

Classes are `engine.priority.Priority` names (sheddable, standard, critical). Defaults:
class standard, max_class the higher of standard and `class`, weight 1. Without a keys
file the one anonymous caller may ask for any class.

Keys are kept only as SHA-256 digests, so a heap dump does not leak them; a lookup
hashes the presented key.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from engine.priority import Priority

# Refusals: no valid key (UNAUTHENTICATED / HTTP 401), or a valid key without the right
# (PERMISSION_DENIED / HTTP 403); their statuses live in the one table.
from services.common.status import AuthError as AuthError
from services.common.status import PermissionDeniedError

MIN_KEY_CHARS = 16
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False
    tokens_per_minute: int = 0  # 0: the gateway's default quota
    default_class: Priority = Priority.STANDARD  # a request that asks for none
    max_class: Priority = Priority.STANDARD  # the highest a request may ask for
    weight: float = 1.0  # the tenant's fair share of contested capacity

    def require_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDeniedError(
                f"{what} needs an admin key; tenant {self.tenant!r} has none"
            )

    def priority_for(self, asked: Priority | None, field: str = "priority") -> Priority:
        """The class a request runs in: `asked` (None: this key's default). Above the
        key's highest class: PermissionDeniedError naming `field`."""
        if asked is None:
            return self.default_class
        if asked > self.max_class:
            raise PermissionDeniedError(
                f"{field}: tenant {self.tenant!r} may ask for at most {self.max_class.label}, "
                f"not {asked.label}"
            )
        return asked


#: The caller when the gateway runs without a keys file: one anonymous tenant, trusted
#: with every right and every class.
ANONYMOUS = Principal(tenant="", admin=True, max_class=Priority.CRITICAL)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _parse_line(line: str, where: str) -> tuple[bytes, Principal] | None:
    words = line.split("#", 1)[0].split()
    if not words:
        return None
    if len(words) < 2:
        raise ValueError(f"{where}: expected '<tenant> <key> [admin] [tpm=N] [class=C] ...'")
    tenant, key, *flags = words
    if not TENANT_RE.match(tenant):
        raise ValueError(f"{where}: tenant {tenant!r} must match {TENANT_RE.pattern}")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{where}: key must have at least {MIN_KEY_CHARS} characters")
    try:
        return _digest(key), _principal(tenant, flags)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


OPTIONS = "admin, tpm=N, class=C, max_class=C, weight=W"


def _principal(tenant: str, flags: list[str]) -> Principal:
    """The tenant with a key's options; ValueError naming the bad one."""
    principal = Principal(tenant)
    seen: set[str] = set()
    for flag in flags:
        name, _, value = flag.partition("=")
        if name in seen:
            raise ValueError(f"option {name!r} given twice")
        seen.add(name)
        if flag == "admin":
            principal = replace(principal, admin=True)
        elif name == "tpm" and value.isdigit():
            principal = replace(principal, tokens_per_minute=int(value))
        elif name == "class":
            principal = replace(principal, default_class=Priority.parse(value, name))
        elif name == "max_class":
            principal = replace(principal, max_class=Priority.parse(value, name))
        elif name == "weight":
            principal = replace(principal, weight=_weight(value))
        else:
            raise ValueError(f"unknown option {flag!r} ({OPTIONS})")
    if "max_class" not in seen:  # a default above standard may be asked for, too
        principal = replace(principal, max_class=max(principal.default_class, Priority.STANDARD))
    if principal.default_class > principal.max_class:
        raise ValueError(
            f"class={principal.default_class.label} is above max_class={principal.max_class.label}"
        )
    return principal


def _weight(text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight must be a number > 0, got {text!r}")
    return weight


class ApiKeys:
    """An immutable key table; `authenticate` is safe to call from any task or thread."""

    def __init__(self, entries: Iterable[tuple[bytes, Principal]]) -> None:
        self._by_digest: dict[bytes, Principal] = {}
        for digest, principal in entries:
            if digest in self._by_digest:
                raise ValueError(f"a key is listed twice (tenant {principal.tenant!r})")
            self._by_digest[digest] = principal

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        entries = [_parse_line(line, f"{path}:{n}") for n, line in enumerate(lines, 1)]
        keys = cls(e for e in entries if e is not None)
        if not keys._by_digest:
            raise ValueError(f"{path}: no keys (remove --api-keys-file to run without auth)")
        return keys

    def __len__(self) -> int:
        return len(self._by_digest)

    def any_quota(self) -> bool:
        """Whether some key carries its own tokens-per-minute limit."""
        return any(p.tokens_per_minute > 0 for p in self._by_digest.values())

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise AuthError("missing API key: send 'authorization: Bearer <key>'")
        # A dict lookup by digest: its timing can reveal at most how a guess's SHA-256
        # compares with a stored one, which says nothing usable about the key.
        principal = self._by_digest.get(_digest(key))
        if principal is None:
            raise AuthError("invalid API key")
        return principal


def key_from_headers(headers: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The API key in gRPC metadata or HTTP headers (names compared case-insensitively)."""
    bearer: str | None = None
    plain: str | None = None
    for name, raw in headers:
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        lowered = name.lower()
        if lowered == "authorization" and value[:7].lower() == "bearer ":
            bearer = value[7:].strip()
        elif lowered == "x-api-key":
            plain = value.strip()
    return bearer or plain
