"""Starting and stopping the processes of a local cluster (`pdserve up`).

Lifecycle: `LocalCluster(cfg).start()` starts an embedded Redis for the router's
registry (placement `redis`, the default), launches the workers (each registers there
and prints a JSON ready line with its address), then `cfg.gateways` gateways (the first
on `gateway_port`, any others on free ports; all with the same flags, workers and
Redis, so they act as replicas behind one load balancer), and waits until every
process answered; `stop()` sends SIGTERM to the gateways, then the workers, waits for
them to drain, SIGKILLs any straggler, and stops Redis. Children also get SIGTERM from
the kernel if this process dies first (each asks for PR_SET_PDEATHSIG at start), so no
orphan outlives `pdserve up`.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from services.cluster.config import (
    GATEWAY_PASSTHROUGH,
    LORA_PASSTHROUGH,
    WORKER_PASSTHROUGH,
    ClusterConfig,
)
from services.common.config import config_args
from services.common.model_config import extra_model_dirs
from services.common.telemetry_config import TelemetryConfig, telemetry_args
from services.common.tls import TlsConfig
from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_ha import EmbeddedRedisHA

_PR_SET_PDEATHSIG = 1
GATEWAY = "gateway"  # the first gateway's name; replicas are gateway-1, gateway-2, ...


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


def pin_to_cores(cores: set[int]) -> None:
    """Restrict every thread of this process, and the threads it starts later, to `cores`.

    Called by the worker itself (`pdserve worker --cpu-cores 0`) for the same reason as
    `die_with_parent`. Threads already running (gRPC, tokenizer pools) are pinned one by
    one: sched_setaffinity(0) would move only the calling thread.
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def gateway_name(index: int) -> str:
    """`gateway` for the first (what single-gateway code looks up), then `gateway-1`..."""
    return GATEWAY if index == 0 else f"{GATEWAY}-{index}"


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    address: str = ""
    http_address: str = ""  # the gateway's OpenAI HTTP API, when it serves one
    metrics_port: int | None = None  # its Prometheus /metrics port, when it serves one
    is_gateway: bool = False  # a gateway replica, not a worker


class LocalCluster:
    def __init__(
        self,
        cfg: ClusterConfig,
        telemetry: TelemetryConfig | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.telemetry = telemetry or TelemetryConfig()
        self.tls = tls or TlsConfig()  # every child serves and dials with it
        self.children: list[Child] = []
        self.gateway_address = ""  # the first gateway's; `gateway_addresses` has them all
        self.http_address = ""
        self.redis: EmbeddedRedis | EmbeddedRedisHA | None = None

    @property
    def gateways(self) -> list[Child]:
        """The gateway replicas, first one first."""
        return [c for c in self.children if c.is_gateway]

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if not c.is_gateway]

    @property
    def gateway_addresses(self) -> list[str]:
        """Every gateway's gRPC address, in `gateways` order."""
        return [c.address for c in self.gateways]

    @property
    def http_addresses(self) -> list[str]:
        """Every gateway's OpenAI HTTP address (empty strings when HTTP is off)."""
        return [c.http_address for c in self.gateways]

    def _common(self) -> list[str]:
        args = ["--model-cache-dir", str(self.cfg.model_cache_dir)]
        return args + (["--model", self.cfg.model] if self.cfg.model else [])

    def _launch(self, name: str, args: list[str]) -> Child:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "--die-with-parent", *args,
             *self._telemetry_args(name), *config_args(self.tls)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        child = Child(name, proc, is_gateway=args[0] == "gateway")
        self.children.append(child)
        return child

    def _telemetry_args(self, name: str) -> list[str]:
        """The same telemetry flags for every child; a fixed metrics port goes to the
        first gateway only (the other children take any free port and announce it)."""
        port = self.telemetry.metrics_port
        own = port if name == GATEWAY else min(port, 0)
        return telemetry_args(self.telemetry, metrics_port=own)

    def _worker_args(self, role: str, index: int) -> list[str]:
        return ["worker", "--role", role, "--worker-id", f"{role}-{index}",
                "--num-threads", str(self.cfg.worker_threads),
                "--kv-cache-bytes", str(self.cfg.worker_kv_cache_bytes),
                "--kv-backend", self.cfg.kv_backend,
                *self._pin_args(role, index), *self._common(), *self._redis_args(),
                *self._passthrough(WORKER_PASSTHROUGH + LORA_PASSTHROUGH),
                *shlex.split(self.cfg.worker_args)]  # fmt: skip

    def _extra_model_args(self, name: str, model_dir: str) -> list[str]:
        """The one mixed worker of an extra model: it registers in that model's pool (its
        name comes last: a repeated flag's last value wins over the primary's name)."""
        return ["worker", "--role", "mixed", "--worker-id", f"{name}-0",
                "--model", model_dir, "--model-cache-dir", str(self.cfg.model_cache_dir),
                "--num-threads", str(self.cfg.worker_threads),
                "--kv-cache-bytes", str(self.cfg.worker_kv_cache_bytes),
                "--kv-backend", self.cfg.kv_backend, *self._redis_args(),
                *self._passthrough(WORKER_PASSTHROUGH),
                "--served-model-name", name]  # fmt: skip

    def _passthrough(self, names: tuple[str, ...]) -> list[str]:
        """`--flag value` for each of `names` that is set (None or "" keeps the child's
        default)."""
        args: list[str] = []
        for name in names:
            value = getattr(self.cfg, name)
            if value is not None and value != "":
                args += ["--" + name.replace("_", "-"), str(value)]
        return args

    def _pin_args(self, role: str, index: int) -> list[str]:
        if not self.cfg.pin_workers:
            return []
        # One core per worker, prefill workers first: 1 prefill + 1 decode (or 2 mixed)
        # on a 2-core host get a core each; the gateway and Redis float.
        slot = index if role == "prefill" else self.cfg.num_prefill + index
        cores = sorted(os.sched_getaffinity(0))
        return ["--cpu-cores", str(cores[slot % len(cores)])]

    def _gateway_args(self, prefill: list[Child], decode: list[Child], index: int) -> list[str]:
        """Replicas after the first bind any free ports: two cannot share a fixed one."""
        return [
            "gateway",
            "--gateway-port",
            str(self.cfg.gateway_port if index == 0 else 0),
            "--prefill-workers",
            ",".join(f"{c.name}={c.address}" for c in prefill),
            "--decode-workers",
            ",".join(f"{c.name}={c.address}" for c in decode),
            "--max-streams",
            str(self.cfg.max_streams),
            "--http-port",
            str(self._http_port(index)),
            "--placement",
            self.cfg.placement,
            *self._common(),
            *self._redis_args(),
            *self._passthrough(GATEWAY_PASSTHROUGH),
            *shlex.split(self.cfg.gateway_args),
        ]

    def _http_port(self, index: int = 0) -> int:
        port = self.cfg.http_port
        if port is None:
            # Tests and demos ask for any gRPC port; a fixed HTTP port would clash there.
            port = 0 if self.cfg.gateway_port == 0 else 8471
        return port if index == 0 or port < 0 else 0

    def _redis_args(self) -> list[str]:
        return ["--redis-url", self.redis.url] if self.redis is not None else []

    def start(self) -> str:
        """Launch everything; returns the gateway address. Stops all on failure."""
        try:
            if self.cfg.placement == "redis":
                self.redis = EmbeddedRedisHA() if self.cfg.redis_ha else EmbeddedRedis(tcp=True)
                self.redis.start()
            decode_role = "decode" if self.cfg.num_prefill else "mixed"
            prefill = [
                self._launch(f"prefill-{i}", self._worker_args("prefill", i))
                for i in range(self.cfg.num_prefill)
            ]
            decode = [
                self._launch(f"{decode_role}-{i}", self._worker_args(decode_role, i))
                for i in range(self.cfg.num_decode)
            ]
            extra = [
                self._launch(f"{name}-0", self._extra_model_args(name, path))
                for name, path in extra_model_dirs(self.cfg.extra_models).items()
            ]
            deadline = time.monotonic() + self.cfg.startup_timeout_s
            for child in prefill + decode + extra:
                child.address = self._await_ready(child, deadline)
            gateways = [
                self._launch(gateway_name(i), self._gateway_args(prefill, decode, i))
                for i in range(self.cfg.gateways)
            ]
            for gateway in gateways:
                gateway.address = self._await_ready(gateway, deadline)
            self.gateway_address = gateways[0].address
            self.http_address = gateways[0].http_address
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
                ready = json.loads(line)
                child.http_address = str(ready.get("http") or "")
                child.metrics_port = ready.get("metrics_port")
                return str(ready["ready"])

    def add_worker(self, name: str, *extra_args: str) -> Child:
        """Start one more mixed worker, `name` its id too, with the cluster's model, Redis
        and worker flags plus `extra_args` (a repeated flag's last value wins, so
        `--served-model-name m --model-version v2` puts it in that version's pool), and
        wait until it is ready. `stop()` stops it with the rest."""
        args = [*self._worker_args("mixed", 0), "--worker-id", name, *extra_args]
        child = self._launch(name, args)
        child.address = self._await_ready(child, time.monotonic() + self.cfg.startup_timeout_s)
        return child

    def relaunch(self, name: str, *extra_args: str) -> Child:
        """Start an exited child (killed by a fault test, say) again with its original
        arguments plus `extra_args`, and wait until it is ready. A repeated flag's last
        value wins, so `relaunch("prefill-0", "--port", "41000")` brings the worker back
        under its old id on a chosen port. `stop()` stops the new process as usual.
        Call it from a thread that outlives the child: the kernel's parent-death signal
        (`die_with_parent`) fires when the launching *thread* exits."""
        index, old = next((i, c) for i, c in enumerate(self.children) if c.name == name)
        if old.proc.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.proc.pid}); stop it first")
        proc = subprocess.Popen(
            [*(str(a) for a in old.proc.args), *extra_args],  # type: ignore[union-attr]
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        child = self.children[index] = Child(name, proc, is_gateway=old.is_gateway)
        child.address = self._await_ready(child, time.monotonic() + self.cfg.startup_timeout_s)
        return child

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the gateways first, then workers; SIGKILL whatever is left."""
        for child in sorted(self.children, key=lambda c: not c.is_gateway):
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
