"""The committed protobuf stubs match the .proto sources."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "protos"


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    sys.path.insert(0, str(ROOT))
    try:
        from generate import generate
    finally:
        sys.path.remove(str(ROOT))
    generate(tmp_path)
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
