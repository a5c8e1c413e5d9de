"""The commands a user types: `pdserve up --generate` (what `make demo` runs) end to end,
then `pdserve generate` and `pdserve status` against a running cluster."""

from __future__ import annotations

import re
import subprocess
import sys

from services.cluster.local_cluster import ClusterConfig, LocalCluster
from tests.conftest import MODEL_CACHE

PDSERVE = [sys.executable, "-m", "services.cli.main"]


def test_up_generate_streams_and_stops_everything() -> None:
    done = subprocess.run(
        [*PDSERVE, "up", "--gateway-port", "0", "--model-cache-dir", str(MODEL_CACHE),
         "--worker-kv-cache-bytes", str(96 << 20), "--generate", "Say hello.",
         "--max-tokens", "6"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()  # the streamed text
    assert re.search(r"completion [1-6] tokens", done.stderr), done.stderr[-2000:]
    assert "stopping the cluster" in done.stderr


def test_generate_and_status_against_a_running_cluster() -> None:
    cluster = LocalCluster(
        ClusterConfig(gateway_port=0, model_cache_dir=MODEL_CACHE, worker_kv_cache_bytes=96 << 20)
    )
    address = cluster.start()
    try:
        gen = subprocess.run(
            [*PDSERVE, "generate", "--gateway", address, "--max-tokens", "4", "--trace", "Hi!"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr[-2000:]
        assert re.search(r"completion [1-4] tokens", gen.stderr), gen.stderr[-2000:]
        assert "prefill.compute" in gen.stderr  # --trace: the phase timeline
        status = subprocess.run(
            [*PDSERVE, "status", "--gateway", address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr[-2000:]
        assert "prefill-0" in status.stdout and "decode-0" in status.stdout
    finally:
        cluster.stop()
