"""Starting and stopping the processes of a local cluster (`pdserve up`).

Lifecycle: `LocalCluster(cfg).start()` starts an embedded Redis for the router's
registry (placement `redis`, the default), launches the workers (each registers there
and prints a JSON ready line with its address), then the gateway, and waits until every
process answered; `stop()` sends SIGTERM to the gateway, then the workers, waits for
them to drain, SIGKILLs any straggler, and stops Redis. Children also get SIGTERM from
the kernel if this process dies first (each asks for PR_SET_PDEATHSIG at start), so no
orphan outlives `pdserve up`.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import DEFAULT_MODEL_CACHE
from services.router.embedded_redis import EmbeddedRedis

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = field(
        default=1, metadata={"help": "prefill workers (0 = mixed workers only)"}
    )
    num_decode: int = field(
        default=1, metadata={"help": "decode workers (mixed workers when num_prefill is 0)"}
    )
    gateway_port: int = field(default=8470, metadata={"help": "gateway gRPC port (0 = any)"})
    worker_threads: int = field(default=1, metadata={"help": "torch threads per worker"})
    worker_kv_cache_bytes: int = field(
        default=256 << 20, metadata={"help": "KV pool bytes per worker"}
    )
    kv_backend: str = field(default="nixl", metadata={"help": "KV transfer backend: nixl or tcp"})
    model: str | None = field(
        default=None, metadata={"help": "HF-layout model dir (default: SmolLM2-135M-Instruct)"}
    )
    model_cache_dir: Path = field(
        default=DEFAULT_MODEL_CACHE, metadata={"help": "where the default model is converted to"}
    )
    placement: str = field(
        default="redis",
        metadata={"help": "redis (embedded Redis + router registry) or static worker lists"},
    )
    max_streams: int = field(default=64, metadata={"help": "gateway's concurrent stream cap"})
    startup_timeout_s: float = field(
        default=300.0, metadata={"help": "seconds to wait for every process to be ready"}
    )

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("num_prefill must be >= 0 and num_decode >= 1")
        if self.placement not in ("redis", "static"):
            raise ValueError(f"placement must be redis or static, got {self.placement!r}")


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; best effort).

    Called by the child itself (`pdserve --die-with-parent ...`) rather than through a
    preexec hook: forking a process that already runs gRPC threads is unsafe.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    parent = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    address: str = ""


class LocalCluster:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.gateway_address = ""
        self.redis: EmbeddedRedis | None = None

    def _common(self) -> list[str]:
        args = ["--model-cache-dir", str(self.cfg.model_cache_dir)]
        return args + (["--model", self.cfg.model] if self.cfg.model else [])

    def _launch(self, name: str, args: list[str]) -> Child:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "--die-with-parent", *args],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        child = Child(name, proc)
        self.children.append(child)
        return child

    def _worker_args(self, role: str, index: int) -> list[str]:
        return ["worker", "--role", role, "--worker-id", f"{role}-{index}",
                "--num-threads", str(self.cfg.worker_threads),
                "--kv-cache-bytes", str(self.cfg.worker_kv_cache_bytes),
                "--kv-backend", self.cfg.kv_backend,
                *self._common(), *self._redis_args()]  # fmt: skip

    def _gateway_args(self, prefill: list[Child], decode: list[Child]) -> list[str]:
        return [
            "gateway",
            "--gateway-port",
            str(self.cfg.gateway_port),
            "--prefill-workers",
            ",".join(f"{c.name}={c.address}" for c in prefill),
            "--decode-workers",
            ",".join(f"{c.name}={c.address}" for c in decode),
            "--max-streams",
            str(self.cfg.max_streams),
            "--placement",
            self.cfg.placement,
            *self._common(),
            *self._redis_args(),
        ]

    def _redis_args(self) -> list[str]:
        return ["--redis-url", self.redis.url] if self.redis is not None else []

    def start(self) -> str:
        """Launch everything; returns the gateway address. Stops all on failure."""
        try:
            if self.cfg.placement == "redis":
                self.redis = EmbeddedRedis(tcp=True).start()
            decode_role = "decode" if self.cfg.num_prefill else "mixed"
            prefill = [
                self._launch(f"prefill-{i}", self._worker_args("prefill", i))
                for i in range(self.cfg.num_prefill)
            ]
            decode = [
                self._launch(f"{decode_role}-{i}", self._worker_args(decode_role, i))
                for i in range(self.cfg.num_decode)
            ]
            deadline = time.monotonic() + self.cfg.startup_timeout_s
            for child in prefill + decode:
                child.address = self._await_ready(child, deadline)
            gateway = self._launch("gateway", self._gateway_args(prefill, decode))
            self.gateway_address = self._await_ready(gateway, deadline)
            gateway.address = self.gateway_address
            return self.gateway_address
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _await_ready(child: Child, deadline: float) -> str:
        assert child.proc.stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{child.name} was not ready in time")
            ready, _, _ = select.select([child.proc.stdout], [], [], remaining)
            if not ready:
                continue
            line = child.proc.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"{child.name} exited with code {child.proc.wait()} before it was ready"
                )
            if line.startswith("{"):
                return str(json.loads(line)["ready"])

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the gateway first, then workers; SIGKILL whatever is left."""
        for child in sorted(self.children, key=lambda c: c.name != "gateway"):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for child in self.children:
            try:
                child.proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        self.children.clear()
        if self.redis is not None:
            self.redis.close()
            self.redis = None
