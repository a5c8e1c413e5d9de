"""The transfer benchmark's handle on its exporter process.

Lifecycle: `ExporterPeer(model_dir, num_blocks, timeout_s)` starts
`python -m loadtest.transfer.exporter` and waits for its `ready` line (the exporters'
addresses and incarnations, in `endpoints`); `export` and `leases` are one JSON-line
round trip each, every answer bounded by `timeout_s`; `close` asks the process to exit
and kills it if it does not within 10 s. The process is stopped on every exit path: a
peer that fails to start closes it before raising.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.v1 import common_pb2


@dataclass(frozen=True)
class LeaseCounts:
    granted: int
    released: int
    expired: int
    active: int


class ExporterPeer:
    """Starts the exporter process, asks it for exports, and always stops it."""

    def __init__(self, model_dir: Path, num_blocks: int, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.transfer.exporter",
             "--model-dir", str(model_dir), "--num-blocks", str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )  # fmt: skip
        try:
            ready = self._read()
        except BaseException:
            self.close()
            raise
        self.endpoints: dict[str, tuple[str, str]] = {
            name: (str(v[0]), str(v[1])) for name, v in ready["ready"].items()
        }

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + self._timeout_s
        while b"\n" not in self._buffer:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"exporter process gave no answer in {self._timeout_s}s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"exporter process exited with {self.proc.wait()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _send(self, data: bytes) -> None:
        # stdin is unbuffered (bufsize=0): a pipe write may be partial for long commands.
        assert self.proc.stdin is not None
        view = memoryview(data)
        while view:
            view = view[self.proc.stdin.write(view) or 0 :]

    def call(self, **cmd: object) -> dict[str, Any]:
        self._send(json.dumps(cmd).encode() + b"\n")
        return self._read()

    def export(self, backend: str, blocks: Sequence[int]) -> common_pb2.KvHandle:
        reply = self.call(cmd="export", backend=backend, blocks=list(blocks))
        return common_pb2.KvHandle.FromString(base64.b64decode(reply["handle"]))

    def leases(self) -> tuple[dict[str, LeaseCounts], int]:
        """Lease counts per backend, and how many requests the exporter still pins."""
        reply = self.call(cmd="stats")
        counts = {
            name: LeaseCounts(s["granted"], s["released"], s["expired"], s["active"])
            for name, s in reply["leases"].items()
        }
        return counts, int(reply["pinned_requests"])

    def close(self) -> None:
        """Ask the process to exit; kill it if it does not within 10 s. Idempotent."""
        if self.proc.poll() is None:
            try:
                self._send(b'{"cmd": "exit"}\n')
                self.proc.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
