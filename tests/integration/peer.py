"""Test-side handle on a `kv_peer` process (start, command, kill, always stop), and the
exporter's side of a KV-transfer test's leak check (`assert_clean`)."""

from __future__ import annotations

import base64
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from pdserve.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


class PeerProcess:
    def __init__(
        self, backend: str, *, port: int = 0, lease_ttl: float = 30.0, kv_cache_dtype: str = "auto"
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.kv_peer", "--backend", backend,
             "--port", str(port), "--lease-ttl", str(lease_ttl),
             "--kv-cache-dtype", kv_cache_dtype],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        ready = self._read(timeout=180)
        self.address: str = ready["ready"]
        self.incarnation: str = ready["incarnation"]

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("kv_peer did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kv_peer exited with {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, **cmd: object) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout=120)

    def prefill(self, prompt: list[int]) -> common_pb2.KvHandle:
        (handle,) = self.prefill_many([prompt])
        return handle

    def prefill_many(self, prompts: list[list[int]]) -> list[common_pb2.KvHandle]:
        """Prefill the prompts in one batch and lease each one's KV."""
        reply = self.call(cmd="prefill", prompts=prompts)
        return [common_pb2.KvHandle.FromString(base64.b64decode(h)) for h in reply["handles"]]

    def stats(self) -> dict[str, Any]:
        return self.call(cmd="stats")

    def wait_stats(self, predicate: Any, timeout: float = 5.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        stats = self.stats()
        while not predicate(stats) and time.monotonic() < end:
            time.sleep(0.05)
            stats = self.stats()
        return stats

    def release(self, lease_id: str) -> bool:
        """Give a lease back over the real KvTransfer Release RPC, as the importer does
        after its read; False if it had already ended."""
        with grpc.insecure_channel(self.address) as channel:
            reply = kvtransfer_pb2_grpc.KvTransferStub(channel).Release(
                kvtransfer_pb2.ReleaseRequest(lease_id=lease_id), timeout=10
            )
        return bool(reply.released)

    def assert_clean(self, expired_before: int) -> dict[str, Any]:
        """The exporter's side of the leak check: no block used or held, no request held
        for export, no live lease, and no lease ended by expiry since `expired_before`
        (its `stats()["expired"]` when the test started)."""
        stats = self.wait_stats(lambda s: s["used_blocks"] == s["active_leases"] == 0)
        assert stats["used_blocks"] == stats["held_blocks"] == stats["held_requests"] == 0, stats
        assert stats["active_leases"] == 0 and stats["expired"] == expired_before, stats
        return stats

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="exit")
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)
