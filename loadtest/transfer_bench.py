"""KV-transfer benchmark: NIXL and the TCP fallback between two processes, against memcpy.

Lifecycle of one run (`python -m loadtest.transfer_bench`):

1. Flags become a frozen `BenchConfig`. Only the default model's KV layout is needed (its
   config.json, no weights are loaded): fp32, 16-token blocks, like a CPU engine.
2. An exporter process is spawned (`--serve-exporter`, the same module). It allocates a
   KV pool with the engine's allocator, fills it with a known pattern (element i of the
   flat pool holds the int32 i), and starts one real `KvExporter` per backend (nixl,
   tcp) over that pool. `PinnedRanges` stands in for an engine's pinned blocks: it pins
   whatever block ids the bench asks for; the real engine path is covered by
   tests/integration/test_kv_transfer.py. The bench asks for exports over the child's
   stdin/stdout (JSON lines: test-harness scaffolding); the handshake and every byte of
   KV go through the real KvTransfer gRPC service and the real backends.
3. This process builds its own pool, handshakes each exporter and connects a
   `NixlImportBackend` and a `TcpImportBackend` to it, exactly as `KvImporter` does.
4. Per prompt size and block pattern (`contig`: runs [k, k+n) on both sides, what a fresh
   engine allocates, and where the targets apply; `scatter`: random blocks on both
   sides), one verified import per backend (destination zeroed, then compared bitwise
   with the pattern; it doubles as warm-up), then repetitions, interleaved so that the
   shared machine's noise hits every side alike: single-thread libc memcpy of the same
   number of bytes between two preallocated huge-page-advised buffers (the baseline),
   torch `copy_` of the same (context), a NIXL import, a TCP import. Medians are reported.
5. The fixed overhead of importing one block (read + release) is timed per backend.
6. Every lease must end by release (none expired, none left active); the exporter is
   stopped on every exit path (killed if it does not stop). A table is printed and all
   numbers go to `--out` as JSON. The exit code is 0 whether or not targets are met.

Descriptors: NIXL is handed one (layer, K/V, block) unit per descriptor and merges runs
of adjacent units; the merged count printed is computed from the block runs (it matches
NIXL's own telemetry `descCount`). The TCP fallback's count is its gRPC messages.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from engine.config import DEFAULT_MODEL_CACHE
from engine.kv_cache import KvLayout, allocate_kv_cache
from engine.kv_handoff import HeldKv
from engine.model_spec import ModelSpec
from engine.model_store import prepare_default_model
from kvtransfer.backend import ImportBackend, ReadResult
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import handshake
from kvtransfer.layout import check_layout
from kvtransfer.tcp_backend import TcpImportBackend
from pdserve.v1 import common_pb2

SCHEMA = "pdserve.transfer_bench/1"
BACKENDS = ("nixl", "tcp")
PATTERNS = ("contig", "scatter")
BLOCK_SIZE = 16
#: Spare blocks beyond the largest transfer, so contiguous runs can start off block 0.
HEADROOM_BLOCKS = 16
#: The issue's targets: at TARGET_TOKENS (contiguous blocks), NIXL GB/s against memcpy
#: and against the fallback; and the median one-block import (read + release) over NIXL.
TARGET_TOKENS = 8192
TARGET_VS_MEMCPY = 0.6
TARGET_VS_TCP = 2.0
TARGET_ONE_BLOCK_MS = 1.0
ONE_BLOCK_WARMUP = 20
IMPORT_TIMEOUT_S = 30.0
CPU = torch.device("cpu")


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run depends on; recorded verbatim in the JSON."""

    token_counts: tuple[int, ...] = (512, 2048, 8192)
    reps: int = 7
    tcp_reps: int = 5
    overhead_reps: int = 300
    model_cache_dir: Path = DEFAULT_MODEL_CACHE
    out: Path = Path("bench-results/transfer.json")
    seed: int = 0
    peer_timeout_s: float = 120.0
    #: UCX_* / NIXL_* variables of this run (both processes inherit them), for the record.
    transport_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.token_counts or any(t <= 0 for t in self.token_counts):
            raise ValueError(f"token_counts must be positive, got {self.token_counts}")
        if self.reps < 1 or not 1 <= self.tcp_reps <= self.reps or self.overhead_reps < 1:
            raise ValueError("need reps >= 1, 1 <= tcp_reps <= reps and overhead_reps >= 1")
        if self.peer_timeout_s <= 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {self.peer_timeout_s}")

    @property
    def num_blocks(self) -> int:
        return -(-max(self.token_counts) // BLOCK_SIZE) + HEADROOM_BLOCKS


@dataclass(frozen=True)
class CaseResult:
    tokens: int
    blocks: int
    pattern: str
    bytes: int
    memcpy_gbps: float
    torch_copy_gbps: float
    nixl_gbps: float
    tcp_gbps: float
    nixl_vs_memcpy: float
    nixl_vs_torch_copy: float
    nixl_vs_tcp: float
    nixl_unit_descriptors: int
    nixl_merged_descriptors: int
    tcp_messages: int
    verified: dict[str, bool]
    seconds: dict[str, list[float]]


@dataclass(frozen=True)
class OneBlockResult:
    backend: str
    bytes: int
    descriptors: int
    median_ms: float
    p99_ms: float
    mean_ms: float
    verified: bool
    reps: int


@dataclass(frozen=True)
class TargetResult:
    name: str
    measured: float
    threshold: float
    comparison: str  # ">=" or "<="
    met: bool


@dataclass(frozen=True)
class LeaseCounts:
    granted: int
    released: int
    expired: int
    active: int


@dataclass(frozen=True)
class MachineInfo:
    """The host, for the record; load averages (1/5/15 min) say how busy it was."""

    cpu_count: int
    loadavg_start: list[float]
    loadavg_end: list[float]
    torch_threads: int
    torch_version: str
    nixl_version: str
    python: str
    platform: str
    processor: str
    transparent_hugepage: str


@dataclass(frozen=True)
class LayoutInfo:
    """The KV layout moved: the default model's, fp32, on CPU."""

    layout: KvLayout
    bytes_per_token: int
    bytes_per_block: int
    unit_bytes: int  # one block of one layer's K or V: NIXL's unit descriptor
    pool_blocks: int
    pool_bytes: int


@dataclass(frozen=True)
class BenchReport:
    schema: str
    started_at: str
    finished_at: str
    wall_s: float
    model_dir: str
    exporter_pid: int
    machine: MachineInfo
    layout: LayoutInfo
    config: BenchConfig
    cases: list[CaseResult]
    one_block: list[OneBlockResult]
    leases: dict[str, LeaseCounts]
    verified: bool
    leases_clean: bool
    targets: list[TargetResult]
    targets_met: bool


# -- exporter process -----------------------------------------------------------------
class PinnedRanges:
    """A `HeldKvProvider` over a bare pool: it stands in for an engine's pinned blocks.

    `pin` records block ids under a request id; `held_kv` describes them to the exporter;
    `release_held` (called exactly once per lease by the exporter) forgets them.
    """

    def __init__(self) -> None:
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
    pool = allocate_kv_cache(layout, num_blocks, CPU)
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


def serve_exporter(argv: Sequence[str]) -> int:
    """Child entry point: serve exports of a patterned pool until `exit` or stdin EOF."""
    proto = _protocol_stream()
    p = argparse.ArgumentParser(prog="python -m loadtest.transfer_bench --serve-exporter")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--num-blocks", type=int, required=True)
    args = p.parse_args(argv)
    layout = layout_for(args.model_dir)
    pool = patterned_pool(layout, args.num_blocks)
    pinned = PinnedRanges()
    exporters: dict[str, KvExporter] = {}
    try:
        for name in BACKENDS:
            exp = KvExporter(layout, pool, pinned, TransferConfig(kv_backend=name),
                             engine_id=f"bench-exporter-{name}")  # fmt: skip
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


# -- the bench's handle on the exporter process ---------------------------------------
class ExporterPeer:
    """Starts the exporter process, asks it for exports, and always stops it."""

    def __init__(self, model_dir: Path, num_blocks: int, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.transfer_bench", "--serve-exporter",
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


# -- this process: importers and the memcpy baseline ----------------------------------
@dataclass
class Link:
    """One connected import backend (what KvImporter holds per exporter incarnation)."""

    backend: ImportBackend
    peer_key: str


def connect(
    name: str, layout: KvLayout, pool: torch.Tensor, address: str, timeout_s: float
) -> Link:
    agent_name = f"bench-importer-{name}.{uuid.uuid4().hex[:12]}"
    backend: ImportBackend
    if name == "nixl":
        from kvtransfer.nixl_backend import NixlImportBackend

        backend = NixlImportBackend(pool, agent_name)
    else:
        backend = TcpImportBackend(pool)
    response = handshake(address, layout, agent_name, time.monotonic() + timeout_s)
    check_layout(layout, response.layout)
    peer_key = f"{address}|{response.incarnation}"
    backend.connect(peer_key, response)
    return Link(backend, peer_key)


def timed_import(
    link: Link, handle: common_pb2.KvHandle, src: list[int], dst: list[int]
) -> tuple[ReadResult, float, float]:
    """One import: (result, read seconds, read + release seconds)."""
    deadline = time.monotonic() + IMPORT_TIMEOUT_S
    t0 = time.perf_counter()
    result = link.backend.read(link.peer_key, handle, src, dst, deadline)
    t1 = time.perf_counter()
    link.backend.release(link.peer_key, handle, deadline)
    return result, t1 - t0, time.perf_counter() - t0


class CopyBaseline:
    """Single-thread in-process copies between two preallocated huge-page-advised buffers."""

    def __init__(self, source: torch.Tensor, layout: KvLayout, max_blocks: int) -> None:
        self._src = source.view(-1)
        self._dst = allocate_kv_cache(layout, max_blocks, CPU).view(-1)

    def memcpy(self, nbytes: int) -> float:
        """libc memmove (glibc's memcpy code), the machine's plain copy."""
        t0 = time.perf_counter()
        ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), nbytes)
        return time.perf_counter() - t0

    def torch_copy(self, nbytes: int) -> float:
        n = nbytes // self._src.element_size()
        t0 = time.perf_counter()
        self._dst[:n].copy_(self._src[:n])
        return time.perf_counter() - t0


@dataclass
class Bench:
    """Live state of one run: the peer, the local pool, the pattern and the links."""

    cfg: BenchConfig
    layout: KvLayout
    peer: ExporterPeer
    pool: torch.Tensor
    reference: torch.Tensor
    copies: CopyBaseline
    links: dict[str, Link] = field(default_factory=dict)


def verified_import(
    bench: Bench, name: str, src: list[int], dst: list[int]
) -> tuple[ReadResult, bool]:
    """Zero the destination, import, and compare bitwise with the exporter's pattern."""
    bench.pool[:, :, dst] = 0
    result, _, _ = timed_import(bench.links[name], bench.peer.export(name, src), src, dst)
    got = bench.pool[:, :, dst].view(torch.int32)
    ok = torch.equal(got, bench.reference[:, :, src].view(torch.int32))
    if not ok:
        progress(f"{name} import of {len(src)} blocks does NOT match the source")
    return result, ok


# -- measurements ---------------------------------------------------------------------
def block_ids(pattern: str, n: int, num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """(src, dst) block ids: runs at different offsets, or random blocks on both sides."""
    if pattern == "contig":
        src0, dst0 = HEADROOM_BLOCKS // 2, HEADROOM_BLOCKS // 4
        return list(range(src0, src0 + n)), list(range(dst0, dst0 + n))
    rng = np.random.default_rng([seed, n])
    src = rng.choice(num_blocks, n, replace=False)
    dst = rng.choice(num_blocks, n, replace=False)
    return [int(b) for b in src], [int(b) for b in dst]


def merged_descriptors(src: Sequence[int], dst: Sequence[int], num_layers: int) -> int:
    """Descriptors after NIXL merges runs adjacent on both sides, in every layer and K/V."""
    runs = 1 + sum(
        1 for i in range(1, len(src)) if not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1)
    )
    return runs * 2 * num_layers


def measure_case(bench: Bench, tokens: int, pattern: str) -> CaseResult:
    cfg, layout = bench.cfg, bench.layout
    n = -(-tokens // BLOCK_SIZE)
    nbytes = n * layout.bytes_per_block
    src, dst = block_ids(pattern, n, cfg.num_blocks, cfg.seed)
    nixl_read, nixl_ok = verified_import(bench, "nixl", src, dst)
    tcp_read, tcp_ok = verified_import(bench, "tcp", src, dst)
    times: dict[str, list[float]] = {"memcpy": [], "torch_copy": [], "nixl": [], "tcp": []}
    for rep in range(cfg.reps):
        times["memcpy"].append(bench.copies.memcpy(nbytes))
        times["torch_copy"].append(bench.copies.torch_copy(nbytes))
        for name in BACKENDS if rep < cfg.tcp_reps else ("nixl",):
            handle = bench.peer.export(name, src)
            times[name].append(timed_import(bench.links[name], handle, src, dst)[1])
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return CaseResult(
        tokens=tokens,
        blocks=n,
        pattern=pattern,
        bytes=nbytes,
        memcpy_gbps=gbps["memcpy"],
        torch_copy_gbps=gbps["torch_copy"],
        nixl_gbps=gbps["nixl"],
        tcp_gbps=gbps["tcp"],
        nixl_vs_memcpy=gbps["nixl"] / gbps["memcpy"],
        nixl_vs_torch_copy=gbps["nixl"] / gbps["torch_copy"],
        nixl_vs_tcp=gbps["nixl"] / gbps["tcp"],
        nixl_unit_descriptors=nixl_read.descriptors,
        nixl_merged_descriptors=merged_descriptors(src, dst, layout.num_layers),
        tcp_messages=tcp_read.descriptors,
        verified={"nixl": nixl_ok, "tcp": tcp_ok},
        seconds=times,
    )


def measure_one_block(bench: Bench, name: str) -> OneBlockResult:
    """Fixed overhead: import (read + release) of one block, after a short warm-up."""
    src, dst = [bench.cfg.num_blocks - 1], [bench.cfg.num_blocks - 2]
    result, ok = verified_import(bench, name, src, dst)
    link, samples = bench.links[name], []
    for rep in range(ONE_BLOCK_WARMUP + bench.cfg.overhead_reps):
        handle = bench.peer.export(name, src)
        total = timed_import(link, handle, src, dst)[2]
        if rep >= ONE_BLOCK_WARMUP:
            samples.append(total * 1e3)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    median, mean = statistics.median(samples), statistics.fmean(samples)
    return OneBlockResult(
        name, result.bytes, result.descriptors, median, p99, mean, ok, len(samples)
    )


def wait_leases_settled(peer: ExporterPeer) -> dict[str, LeaseCounts]:
    """NIXL releases arrive as notifications drained every few ms: wait for them."""
    end = time.monotonic() + 5.0
    counts, pinned = peer.leases()
    while (pinned or any(c.active for c in counts.values())) and time.monotonic() < end:
        time.sleep(0.02)
        counts, pinned = peer.leases()
    return counts


def evaluate_targets(
    cases: Sequence[CaseResult], one_block: Sequence[OneBlockResult]
) -> list[TargetResult]:
    targets = []
    for c in cases:
        if c.tokens == TARGET_TOKENS and c.pattern == "contig":
            targets += [
                TargetResult("nixl/memcpy @8192 contig", c.nixl_vs_memcpy, TARGET_VS_MEMCPY,
                             ">=", c.nixl_vs_memcpy >= TARGET_VS_MEMCPY),
                TargetResult("nixl/tcp @8192 contig", c.nixl_vs_tcp, TARGET_VS_TCP,
                             ">=", c.nixl_vs_tcp >= TARGET_VS_TCP),
            ]  # fmt: skip
    for o in one_block:
        if o.backend == "nixl":
            met = o.median_ms <= TARGET_ONE_BLOCK_MS
            targets.append(
                TargetResult("nixl one-block median ms", o.median_ms, TARGET_ONE_BLOCK_MS,
                             "<=", met)
            )  # fmt: skip
    return targets


# -- reporting ------------------------------------------------------------------------
def progress(message: str) -> None:
    print(f"[transfer_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine_info(loadavg_start: Sequence[float]) -> MachineInfo:
    import importlib.metadata as md

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return MachineInfo(
        cpu_count=os.cpu_count() or 0,
        loadavg_start=[round(x, 2) for x in loadavg_start],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        nixl_version=md.version("nixl-cu12"),
        python=platform.python_version(),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        transparent_hugepage=thp.read_text().strip() if thp.exists() else "unknown",
    )


def layout_info(layout: KvLayout, num_blocks: int) -> LayoutInfo:
    return LayoutInfo(
        layout=layout,
        bytes_per_token=layout.bytes_per_token,
        bytes_per_block=layout.bytes_per_block,
        unit_bytes=layout.bytes_per_block_layer,
        pool_blocks=num_blocks,
        pool_bytes=num_blocks * layout.bytes_per_block,
    )


def format_table(report: BenchReport) -> str:
    lay, m = report.layout, report.machine
    rows = [
        f"KV of the default model: {lay.bytes_per_token} bytes/token, {BLOCK_SIZE}-token "
        f"blocks of {lay.unit_bytes} bytes per layer and K/V; baseline: 1-thread memcpy; "
        f"load average {m.loadavg_start} -> {m.loadavg_end} (1/5/15 min) on "
        f"{m.cpu_count} CPUs",
        f"{'tokens':>6} {'pattern':>7} {'MiB':>6} {'memcpy':>7} {'copy_':>6} {'nixl':>6} "
        f"{'tcp':>6} {'nixl/memcpy':>11} {'nixl/tcp':>8}  {'nixl descs unit->merged':>23} "
        f"{'tcp msgs':>8}  (GB/s; medians)",
    ]
    for c in report.cases:
        descs = f"{c.nixl_unit_descriptors}->{c.nixl_merged_descriptors}"
        rows.append(
            f"{c.tokens:>6} {c.pattern:>7} {c.bytes / 2**20:>6.1f} {c.memcpy_gbps:>7.2f} "
            f"{c.torch_copy_gbps:>6.2f} {c.nixl_gbps:>6.2f} {c.tcp_gbps:>6.2f} "
            f"{c.nixl_vs_memcpy:>10.2f}x {c.nixl_vs_tcp:>7.2f}x  {descs:>23} {c.tcp_messages:>8}"
        )
    for o in report.one_block:
        rows.append(
            f"one-block import (read + release) {o.backend}: median {o.median_ms:.3f} ms, "
            f"p99 {o.p99_ms:.3f} ms, {o.reps} reps, {o.descriptors} descriptors"
        )
    rows.append("targets (contiguous blocks, what a fresh engine allocates; scatter is context):")
    for t in report.targets:
        verdict = "met" if t.met else "UNMET"
        rows.append(f"  {t.name:<26} {t.measured:8.3f} {t.comparison} {t.threshold:<5} {verdict}")
    rows.append(
        f"verified bitwise: {report.verified}; leases all released: {report.leases_clean}; "
        f"wall {report.wall_s:.0f}s; all targets met: {report.targets_met}"
    )
    return "\n".join(rows)


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n", encoding="utf-8")


# -- entry point ----------------------------------------------------------------------
def make_bench(cfg: BenchConfig, layout: KvLayout, peer: ExporterPeer) -> Bench:
    reference = patterned_pool(layout, cfg.num_blocks)
    copies = CopyBaseline(reference, layout, cfg.num_blocks - HEADROOM_BLOCKS)
    return Bench(cfg, layout, peer, allocate_kv_cache(layout, cfg.num_blocks, CPU), reference,
                 copies)  # fmt: skip


def measure_all(bench: Bench) -> tuple[list[CaseResult], list[OneBlockResult]]:
    for name in BACKENDS:
        address = bench.peer.endpoints[name][0]
        bench.links[name] = connect(name, bench.layout, bench.pool, address, IMPORT_TIMEOUT_S)
    cases = []
    for tokens in bench.cfg.token_counts:
        for pattern in PATTERNS:
            case = measure_case(bench, tokens, pattern)
            progress(
                f"{tokens} tokens {pattern}: memcpy {case.memcpy_gbps:.2f}, nixl "
                f"{case.nixl_gbps:.2f}, tcp {case.tcp_gbps:.2f} GB/s"
            )
            cases.append(case)
    one_block = [measure_one_block(bench, name) for name in BACKENDS]
    return cases, one_block


def _run_measurements(
    cfg: BenchConfig, layout: KvLayout, model_dir: Path
) -> tuple[list[CaseResult], list[OneBlockResult], dict[str, LeaseCounts], int]:
    """Start the exporter, measure, and stop everything on every exit path."""
    peer = ExporterPeer(model_dir, cfg.num_blocks, cfg.peer_timeout_s)
    progress(f"exporter process {peer.proc.pid} serving {cfg.num_blocks} blocks")
    try:
        bench = make_bench(cfg, layout, peer)
        try:
            cases, one_block = measure_all(bench)
        finally:
            for link in bench.links.values():
                link.backend.close()
        return cases, one_block, wait_leases_settled(peer), peer.proc.pid
    finally:
        peer.close()


def run(cfg: BenchConfig) -> BenchReport:
    """Measure every size and pattern, then the one-block overhead; returns the report."""
    started, t0 = datetime.now(UTC), time.perf_counter()
    load_start = list(os.getloadavg())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the baseline is a single-thread copy
    try:
        model_dir = prepare_default_model(cfg.model_cache_dir.expanduser(), progress=False)
        layout = layout_for(model_dir)
        cases, one_block, leases, pid = _run_measurements(cfg, layout, model_dir)
        machine = machine_info(load_start)
    finally:
        torch.set_num_threads(threads)
    targets = evaluate_targets(cases, one_block)
    clean = all(c.active == c.expired == 0 and c.released == c.granted for c in leases.values())
    verified = all(all(c.verified.values()) for c in cases) and all(o.verified for o in one_block)
    return BenchReport(
        schema=SCHEMA,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        wall_s=time.perf_counter() - t0,
        model_dir=str(model_dir),
        exporter_pid=pid,
        machine=machine,
        layout=layout_info(layout, cfg.num_blocks),
        config=cfg,
        cases=cases,
        one_block=one_block,
        leases=leases,
        verified=verified,
        leases_clean=clean,
        targets=targets,
        # A wrong byte or a stranded lease fails the run whatever its speed.
        targets_met=verified and clean and bool(targets) and all(t.met for t in targets),
    )


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc


def parse_args(
    argv: Sequence[str] | None = None, environ: Callable[[], dict[str, str]] = os.environ.copy
) -> BenchConfig:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.transfer_bench",
        description="KV transfer GB/s over NIXL and the TCP fallback between two processes, "
        "as ratios against a single-thread memcpy measured in the same run.",
    )
    p.add_argument(
        "--tokens",
        type=_token_counts,
        default=BenchConfig.token_counts,
        help="prompt sizes in tokens, comma-separated (default 512,2048,8192)",
    )
    p.add_argument("--reps", type=int, default=BenchConfig.reps)
    p.add_argument("--tcp-reps", type=int, default=None, help="default min(5, reps)")
    p.add_argument("--overhead-reps", type=int, default=BenchConfig.overhead_reps)
    p.add_argument("--model-cache-dir", type=Path, default=DEFAULT_MODEL_CACHE)
    p.add_argument("--out", type=Path, default=BenchConfig.out)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-timeout", type=float, default=BenchConfig.peer_timeout_s)
    a = p.parse_args(argv)  # fmt: skip
    env = environ()
    transport = tuple(sorted((k, v) for k, v in env.items() if k.startswith(("UCX_", "NIXL_"))))
    return BenchConfig(
        token_counts=a.tokens,
        reps=a.reps,
        tcp_reps=a.tcp_reps if a.tcp_reps is not None else min(BenchConfig.tcp_reps, a.reps),
        overhead_reps=a.overhead_reps,
        model_cache_dir=a.model_cache_dir,
        out=a.out,
        seed=a.seed,
        peer_timeout_s=a.peer_timeout,
        transport_env=transport,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--serve-exporter"]:
        return serve_exporter(args[1:])
    cfg = parse_args(args)
    report = run(cfg)
    write_json(report, cfg.out)
    print(format_table(report))
    print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
