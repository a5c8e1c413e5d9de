"""The committed protobuf stubs match the .proto sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "protos"


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    # protoc runs in its own process: its compiler module and the protobuf runtime that
    # this test process already loaded must not share one address space (it crashes).
    subprocess.run([sys.executable, str(ROOT / "generate.py"), str(tmp_path)], check=True)
    fresh = sorted(tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} missing: run python protos/generate.py"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run python protos/generate.py"
        )


def test_stubs_import_as_package() -> None:
    from pdserve.v1 import common_pb2, gateway_pb2_grpc, worker_pb2

    handle = common_pb2.KvHandle(block_ids=[1, 2], num_tokens=20)
    assert common_pb2.KvHandle.FromString(handle.SerializeToString()) == handle
    assert worker_pb2.PrefillRequest(prompt_token_ids=[1]).prompt_token_ids == [1]
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
