"""The transfer benchmark's exporter process: a patterned KV pool served by real exporters.

Lifecycle (`python -m loadtest.transfer.exporter --model-dir D --num-blocks N`, started
by `peer.ExporterPeer`): allocate a KV pool with the engine's allocator in the
default model's layout (fp32, 16-token blocks, like a CPU engine), fill it with a known
pattern (element i of the flat pool holds the int32 i), start one real `KvExporter` per
backend (nixl, tcp) over it, and print one `ready` line. Then answer commands, one JSON
line each on stdin/stdout (test-harness scaffolding: the handshake and every byte of KV
go through the real KvTransfer gRPC service and backends): `export` pins the given
blocks under a fresh request id and returns the exporter's handle; `stats` returns the
lease counts; `exit` (or EOF) closes every exporter and ends the process.

`PinnedRanges` stands in for an engine's pinned blocks: it pins whatever block ids the
bench asks for; the real engine path is covered by tests/integration/test_kv_transfer.py.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch

from engine.kv_handoff import HeldKv
from engine.kv_layout import KvLayout, allocate_blocks
from engine.model_spec import ModelSpec
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter

BACKENDS = ("nixl", "tcp")
BLOCK_SIZE = 16
CPU = torch.device("cpu")


class PinnedRanges:
    """An `ExportPort` over a bare pool: it stands in for an engine's hand-off.

    `pin` records block ids under a request id; `held_kv` describes them to the exporter;
    `release_held` (called exactly once per lease by the exporter) forgets them.
    """

    def __init__(self, layout: KvLayout, kv_blocks: torch.Tensor) -> None:
        self.layout = layout
        self.kv_blocks = kv_blocks
        self._lock = threading.Lock()
        self._held: dict[str, HeldKv] = {}

    def pin(self, request_id: str, block_ids: list[int]) -> None:
        held = HeldKv(request_id, list(block_ids), len(block_ids) * BLOCK_SIZE, [], 0)
        with self._lock:
            self._held[request_id] = held

    def held_kv(self, request_id: str) -> HeldKv:
        with self._lock:
            return self._held[request_id]

    def release_held(self, request_id: str) -> bool:
        with self._lock:
            return self._held.pop(request_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


def layout_for(model_dir: Path) -> KvLayout:
    """The default model's KV layout on CPU: what a CPU engine's pool looks like."""
    return KvLayout.from_spec(ModelSpec.from_dir(model_dir), torch.float32, BLOCK_SIZE, CPU)


def patterned_pool(layout: KvLayout, num_blocks: int) -> torch.Tensor:
    """A pool whose flat element i holds the int32 bit pattern i (checkable anywhere)."""
    pool = allocate_blocks(layout, num_blocks, CPU)
    flat = pool.view(torch.int32).view(-1)
    if flat.numel() > 2**31:
        raise ValueError(f"{num_blocks} blocks are too many for an int32 pattern")
    torch.arange(flat.numel(), dtype=torch.int32, out=flat)
    return pool


def _protocol_stream() -> IO[str]:
    """The real stdout for protocol lines; fd 1 then points at stderr, so that anything
    a native library prints cannot corrupt the protocol."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return stream


def _serve_command(
    cmd: dict[str, Any], exporters: dict[str, KvExporter], pinned: PinnedRanges
) -> dict[str, object]:
    if cmd["cmd"] == "export":
        rid = f"bench-{uuid.uuid4().hex[:12]}"
        pinned.pin(rid, [int(b) for b in cmd["blocks"]])
        handle = exporters[cmd["backend"]].export(rid)
        return {"handle": base64.b64encode(handle.SerializeToString()).decode()}
    if cmd["cmd"] == "stats":
        stats = {name: asdict(exp.stats().leases) for name, exp in exporters.items()}
        return {"leases": stats, "pinned_requests": len(pinned)}
    return {"error": f"unknown command {cmd['cmd']!r}"}


def serve_exporter(argv: Sequence[str] | None = None) -> int:
    """Serve exports of a patterned pool until `exit` or stdin EOF."""
    proto = _protocol_stream()
    p = argparse.ArgumentParser(prog="python -m loadtest.transfer.exporter")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--num-blocks", type=int, required=True)
    args = p.parse_args(argv)
    layout = layout_for(args.model_dir)
    pool = patterned_pool(layout, args.num_blocks)
    pinned = PinnedRanges(layout, pool)
    exporters: dict[str, KvExporter] = {}
    try:
        for name in BACKENDS:
            config = TransferConfig(kv_backend=name)
            exp = KvExporter(pinned, config, engine_id=f"bench-exporter-{name}")
            exporters[name] = exp.start()
        ready = {name: [exp.address, exp.incarnation] for name, exp in exporters.items()}
        proto.write(json.dumps({"ready": ready, "pid": os.getpid()}) + "\n")
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            proto.write(json.dumps(_serve_command(cmd, exporters, pinned)) + "\n")
    finally:
        for exp in exporters.values():
            exp.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve_exporter())
