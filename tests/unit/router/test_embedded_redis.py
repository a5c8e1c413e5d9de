from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_client import connect

# Run alone (`make test`'s serial phase): a server restarted on the port it let go.
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[3]


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("tcp", [False, True])
def test_start_restart_stop_leaves_nothing_behind(tcp: bool) -> None:
    server = EmbeddedRedis(tcp=tcp).start()
    url, first_pid = server.url, server.pid
    assert url.startswith("redis://127.0.0.1:" if tcp else "unix://")
    client = connect(url)
    assert client.set("k", "v") and client.get("k") == "v"
    server.stop()
    assert first_pid is not None and gone(first_pid)
    server.start()  # same address, empty data: a restarted Redis
    assert server.url == url and client.get("k") is None
    client.close()
    pid = server.pid
    server.close()
    assert pid is not None and gone(pid)
    server.close()  # idempotent


def test_server_dies_with_a_killed_parent() -> None:
    code = (
        "from services.router.embedded_redis import EmbeddedRedis\n"
        "import sys, time\n"
        "s = EmbeddedRedis().start()\n"
        "print(s.pid, s.url, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pid_text, url = parent.stdout.readline().split()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    assert gone(int(pid_text)), f"redis-server {pid_text} outlived its killed parent"
    shutil.rmtree(Path(url.removeprefix("unix://")).parent)  # the dead parent's temp dir
