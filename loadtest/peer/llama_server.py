"""llama.cpp's `llama-server` as the peer: its command line, start, readiness and stop.

Lifecycle: `LlamaServer(spec, log_path).start(timeout_s)` launches the binary on
127.0.0.1 and a free port (its output goes to `log_path`), then polls `GET /health`
until the model is loaded (200; 503 while loading) or the process exits or the timeout
passes (RuntimeError naming the log). `stop()` sends SIGTERM, waits, and SIGKILLs a
straggler; the kernel also sends SIGTERM if the benchmark dies first (the child asks
for PR_SET_PDEATHSIG before it executes the server), so no server outlives a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.25


@dataclass(frozen=True)
class LlamaServerSpec:
    """What the server runs: the binary, the model and its serving knobs."""

    binary: Path
    gguf: Path
    threads: int
    slots: int
    ctx_per_slot: int
    extra_args: str = ""


def server_command(spec: LlamaServerSpec, port: int) -> list[str]:
    """The server's argv: `threads` for generation and prompt batches alike, `slots`
    parallel sequences sharing one context of `slots x ctx_per_slot` tokens, continuous
    batching, no web UI; `extra_args` last (a repeated flag's last value wins)."""
    return [
        str(spec.binary),
        "--model", str(spec.gguf),
        "--host", HOST,
        "--port", str(port),
        "--threads", str(spec.threads),
        "--threads-batch", str(spec.threads),
        "--parallel", str(spec.slots),
        "--ctx-size", str(spec.slots * spec.ctx_per_slot),
        "--cont-batching",
        "--no-webui",
        *shlex.split(spec.extra_args),
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the benchmark dies (Linux; best effort)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LlamaServer:
    def __init__(self, spec: LlamaServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout_s: float) -> str:
        """Launch and wait until the model is loaded; returns the base URL."""
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            server_command(self.spec, self.port), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"llama-server exited with code {self.proc.returncode}; see {self.log_path}"
                )
            if self._healthy():
                return self.base_url
            time.sleep(_POLL_S)
        self.stop()
        raise RuntimeError(f"llama-server was not ready in {timeout_s:g} s; see {self.log_path}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2.0) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
