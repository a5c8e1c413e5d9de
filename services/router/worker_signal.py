"""Live load signals of the workers, shared through Redis for the gateway's admission.

Lifecycle of one signal: a worker's publisher (`services/worker/signal_publisher.py`)
calls `SignalBoard.publish` every `--signal-interval-s`, which replaces the worker's
hash `ns:signal:<id>`, stamps it with Redis's own clock and sets it to expire after
`ttl_s`; so the signal of a worker that dies or freezes is gone within `ttl_s`, and one
Redis lost is back at the next publish. On a clean shutdown (from the start of its
drain: it takes no new work) the worker `withdraw`s it. Readers (the gateway's admission
controller) call `read(roles)` each tick: the live signals of the workers registered in
those pools (`ns:pool:<role>`), each with its age in Redis server time. A registered
worker without a signal is simply absent.

Every call is one Lua script run (`worker_signal.lua`), so one round trip, and a
publish is atomic (a reader never sees a signal without its expiry or half written).
Redis errors (`redis.RedisError`, `OSError`) propagate: the caller decides, the
publisher by retrying at its next interval, the gateway by admitting without signals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources

import redis

from engine.priority import Priority
from engine.stats import ClassCounts
from services.common.role import Role
from services.router.keyspace import Keyspace

#: A prefill worker whose queue is under this many seconds has room to decode, whatever
#: the decode worker's queue: a chat prompt's prefill on the development host takes
#: about 0.1-0.6 s. (The gateway's elastic roles and the workers' role planner read the
#: signals with the same two bars.)
IDLE_QUEUE_S = 0.5
#: A decode worker carrying fewer streams than this is not loaded: below it a decode
#: step costs about the same at any batch size, and moving work to it gains nothing.
MIN_DECODE_STREAMS = 2

# Hash fields of the waiting tokens, one per class, in ClassCounts order.
_WAITING_TOKEN_FIELDS = tuple(f"waiting_tokens_{p.label}" for p in Priority)


@dataclass(frozen=True)
class WorkerSignal:
    """One worker's load at its last publish.

    `waiting_tokens` is the prefill the engine still owes by class (uncomputed prompt
    tokens of its waiting and still-prefilling requests, `EngineStats.waiting_tokens_by_class`);
    `waiting` and `running` count its requests. `free_blocks` counts free cached blocks
    as free. The two speeds are the engine's own while busy, smoothed over its recent
    steps (0.0: not measured yet): prompt tokens per second of prefill, and the wall
    time of a step that decoded. `age_s` is filled by the reader.
    """

    worker_id: str
    role: Role
    waiting_tokens: ClassCounts
    waiting: int
    running: int
    free_blocks: int
    total_blocks: int
    block_size: int
    prefill_tokens_per_s: float
    decode_step_s: float
    age_s: float = 0.0  # seconds since it was published, in Redis server time
    # (mean batch, seconds per decode step) by batch size, smallest first (empty: no
    # decode measured yet): `signal_publisher.DecodeCurve`
    decode_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it still owes prefill, every class."""
        return sum(self.waiting_tokens)

    @property
    def queue_s(self) -> float:
        """Seconds its queued prompt tokens take at its measured prefill speed (0.0 while
        the speed is unmeasured)."""
        if self.prefill_tokens_per_s <= 0:
            return 0.0
        return self.queued_tokens / self.prefill_tokens_per_s

    @property
    def kv_utilisation(self) -> float:
        """Share of the KV pool in use, 0.0 to 1.0 (0.0 for an empty pool)."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


class SignalBoard:
    """The signals of one cluster (namespace). Redis errors propagate to the caller.

    `ttl_s` is how long a published signal lives: a publisher must republish well within
    it, and a reader never sees a signal older than it.
    """

    def __init__(self, client: redis.Redis, keys: Keyspace, ttl_s: float = 2.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = client  # decoding responses (`redis_client.connect`)
        self.keys = keys
        self.ttl_s = ttl_s
        text = resources.files("services.router").joinpath("worker_signal.lua").read_text("utf-8")
        self._script = client.register_script(text)

    def publish(self, signal: WorkerSignal) -> None:
        """Replace `signal.worker_id`'s signal and renew its expiry (its `age_s` is
        ignored: the publish time is Redis's)."""
        ttl_ms = max(1, round(self.ttl_s * 1000))
        self._script(keys=[self.keys.signal(signal.worker_id)],
                     args=["publish", ttl_ms, *_encode(signal)])  # fmt: skip

    def withdraw(self, worker_id: str) -> None:
        """Remove a worker's signal at once (a clean shutdown); a no-op if there is none."""
        self.client.delete(self.keys.signal(worker_id))

    def read(self, roles: Iterable[Role]) -> list[WorkerSignal]:
        """The live signals of the workers registered in the `roles` pools, by worker id.

        Expired, withdrawn or never published signals are absent, and so is one whose
        worker is not in those pools (its registration belongs to another role, or it
        has none).
        """
        wanted = list(dict.fromkeys(Role.parse(r) for r in roles))
        if not wanted:
            return []
        res = self._script(keys=[self.keys.pool(r) for r in wanted],
                           args=["read", self.keys.signal_prefix])  # fmt: skip
        assert isinstance(res, list)
        now_us = int(res[0])
        found: dict[str, WorkerSignal] = {}
        for i in range(1, len(res), 2):
            worker_id, flat = str(res[i]), res[i + 1]
            fields = dict(zip(flat[0::2], flat[1::2], strict=True))
            signal = _decode(worker_id, fields, now_us)
            if signal is not None and signal.role in wanted:
                found.setdefault(worker_id, signal)  # stale membership may list it twice
        return sorted(found.values(), key=lambda s: s.worker_id)


def _encode(signal: WorkerSignal) -> list[str | int | float]:
    """The hash's fields and values, flat (redis-py writes a float as its repr, which
    reads back exactly)."""
    waiting_tokens = zip(_WAITING_TOKEN_FIELDS, signal.waiting_tokens, strict=True)
    pairs: list[tuple[str, str | int | float]] = [
        ("role", signal.role.value),
        *waiting_tokens,
        ("waiting", signal.waiting),
        ("running", signal.running),
        ("free_blocks", signal.free_blocks),
        ("total_blocks", signal.total_blocks),
        ("block_size", signal.block_size),
        ("prefill_tokens_per_s", float(signal.prefill_tokens_per_s)),
        ("decode_step_s", float(signal.decode_step_s)),
        ("decode_curve", ",".join(f"{float(b)!r}:{float(t)!r}" for b, t in signal.decode_curve)),
    ]
    return [x for pair in pairs for x in pair]


def _curve(text: str) -> tuple[tuple[float, float], ...]:
    """`"1.0:0.02,3.7:0.03"` -> ((1.0, 0.02), (3.7, 0.03)); ValueError when malformed."""
    points = []
    for pair in filter(None, text.split(",")):
        batch, step_s = pair.split(":")
        points.append((float(batch), float(step_s)))
    return tuple(points)


def _decode(worker_id: str, fields: Mapping[str, str], now_us: int) -> WorkerSignal | None:
    """The signal in a hash, or None when it is not one this code can read (a publisher
    of another version): a reader skips that worker rather than fail the whole read."""
    try:
        return WorkerSignal(
            worker_id=worker_id,
            role=Role.parse(fields["role"]),
            waiting_tokens=ClassCounts(*(int(fields[f]) for f in _WAITING_TOKEN_FIELDS)),
            waiting=int(fields["waiting"]),
            running=int(fields["running"]),
            free_blocks=int(fields["free_blocks"]),
            total_blocks=int(fields["total_blocks"]),
            block_size=int(fields["block_size"]),
            prefill_tokens_per_s=float(fields["prefill_tokens_per_s"]),
            decode_step_s=float(fields["decode_step_s"]),
            age_s=max(0.0, (now_us - int(fields["published_us"])) / 1e6),
            decode_curve=_curve(fields.get("decode_curve", "")),
        )
    except (KeyError, ValueError):
        return None
