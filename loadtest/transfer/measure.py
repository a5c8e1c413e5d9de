"""The transfer benchmark's measurements: GB/s per size and block pattern, and the fixed
cost of a one-block import.

Lifecycle: `make_rig` builds the run's `TransferRig` (this process's pool, the pattern
to check imports against, the copy baseline) around a started `ExporterPeer`;
`measure_all` connects one `Link` per backend into it, then, per prompt size and block
pattern (`contig`: runs [k, k+n) on both sides, what a fresh engine allocates, and where
the targets apply; `scatter`: random blocks on both sides), runs one verified import
per backend (destination zeroed, then compared bitwise with the pattern; it doubles as
warm-up) and `reps` repetitions, interleaved so that the shared machine's noise hits
every side alike: memcpy, torch `copy_`, a NIXL import and a checked NIXL import (its
blocks read in chunks and hashed against the exporter's checksums, as `KvImporter` does;
the two in alternating order, and their ratio taken per round), a TCP import (the first
`tcp_reps` only). The exporter's own hashing of the blocks is timed in this process on
the same bytes. Medians are reported. Then the one-block import (read + release) is
timed per backend. The caller closes the links and stops the peer;
`wait_leases_settled` reads the exporter's lease counts once its releases have landed.

Descriptors: NIXL is handed one (layer, K/V, block) unit per descriptor and merges runs
of adjacent units; the merged count reported is computed from the block runs (it
matches NIXL's own telemetry `descCount`). The TCP fallback's count is its gRPC messages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kv_layout import KvLayout, allocate_blocks
from kvtransfer.backend import ReadResult
from kvtransfer.checked_read import ReadChecker
from kvtransfer.checksum import block_checksums
from kvtransfer.fault import BitFlips
from loadtest.harness.bench_main import Progress
from loadtest.transfer.config import HEADROOM_BLOCKS, TransferBenchConfig
from loadtest.transfer.exporter import BACKENDS, BLOCK_SIZE, CPU, patterned_pool
from loadtest.transfer.links import (
    IMPORT_TIMEOUT_S,
    CopyBaseline,
    Link,
    connect,
    timed_checked_import,
    timed_import,
)
from loadtest.transfer.peer import ExporterPeer, LeaseCounts

PATTERNS = ("contig", "scatter")
COPIES = ("memcpy", "torch_copy")
ONE_BLOCK_WARMUP = 20
progress = Progress("transfer_bench")


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
    # Checksums: a checked NIXL import's GB/s; the median over rounds of its time over
    # the plain import's in the same round (1.0 = free); the checker's median wait for
    # hashes after its last read; the exporter's hashing of the same blocks.
    nixl_checked_gbps: float
    checked_vs_plain: float
    verify_wait_ms: float
    export_hash_ms: float
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


@dataclass
class TransferRig:
    """Live state of one run: the peer, the local pool, the pattern and the links."""

    cfg: TransferBenchConfig
    seed: int
    layout: KvLayout
    peer: ExporterPeer
    pool: torch.Tensor
    reference: torch.Tensor
    copies: CopyBaseline
    checker: ReadChecker
    links: dict[str, Link] = field(default_factory=dict)


def make_rig(
    cfg: TransferBenchConfig, seed: int, layout: KvLayout, peer: ExporterPeer
) -> TransferRig:
    reference = patterned_pool(layout, cfg.num_blocks)
    copies = CopyBaseline(reference, layout, cfg.num_blocks - HEADROOM_BLOCKS)
    pool = allocate_blocks(layout, cfg.num_blocks, CPU)
    checker = ReadChecker(pool, BitFlips())
    return TransferRig(cfg, seed, layout, peer, pool, reference, copies, checker)


def verified_import(
    rig: TransferRig, name: str, src: list[int], dst: list[int]
) -> tuple[ReadResult, bool]:
    """Zero the destination, import, and compare bitwise with the exporter's pattern."""
    rig.pool[dst] = 0
    result, _, _ = timed_import(rig.links[name], rig.peer.export(name, src), src, dst)
    got = rig.pool[dst].view(torch.int32)
    ok = torch.equal(got, rig.reference[src].view(torch.int32))
    if not ok:
        progress(f"{name} import of {len(src)} blocks does NOT match the source")
    return result, ok


def block_ids(pattern: str, n: int, num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """(src, dst) block ids: runs at different offsets, or random blocks on both sides."""
    if pattern == "contig":
        src0, dst0 = HEADROOM_BLOCKS // 2, HEADROOM_BLOCKS // 4
        return list(range(src0, src0 + n)), list(range(dst0, dst0 + n))
    rng = np.random.default_rng([seed, n])
    src = rng.choice(num_blocks, n, replace=False)
    dst = rng.choice(num_blocks, n, replace=False)
    return [int(b) for b in src], [int(b) for b in dst]


def merged_descriptors(src: Sequence[int], dst: Sequence[int]) -> int:
    """Descriptors after NIXL merges runs of blocks adjacent on both sides."""
    return 1 + sum(
        1 for i in range(1, len(src)) if not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1)
    )


def measure_case(rig: TransferRig, tokens: int, pattern: str) -> CaseResult:
    cfg, layout = rig.cfg, rig.layout
    n = -(-tokens // BLOCK_SIZE)
    nbytes = n * layout.bytes_per_block
    src, dst = block_ids(pattern, n, cfg.num_blocks, rig.seed)
    nixl_read, nixl_ok = verified_import(rig, "nixl", src, dst)
    tcp_read, tcp_ok = verified_import(rig, "tcp", src, dst)
    times: dict[str, list[float]] = {
        "memcpy": [], "torch_copy": [], "nixl": [], "nixl_checked": [], "tcp": [],
        "verify_wait": [], "export_hash": [],
    }  # fmt: skip
    checked_ok = True
    for rep in range(cfg.reps):
        times["memcpy"].append(rig.copies.memcpy(nbytes))
        times["torch_copy"].append(rig.copies.torch_copy(nbytes))
        for side in ("nixl", "nixl_checked") if rep % 2 else ("nixl_checked", "nixl"):
            handle = rig.peer.export("nixl", src)
            if side == "nixl":
                times["nixl"].append(timed_import(rig.links["nixl"], handle, src, dst)[1])
                continue
            checked, seconds = timed_checked_import(
                rig.links["nixl"], rig.checker, handle, src, dst
            )
            times["nixl_checked"].append(seconds)
            times["verify_wait"].append(checked.verify_seconds)
            checked_ok = checked_ok and checked.mismatches == 0
        if rep < cfg.tcp_rep_count:
            handle = rig.peer.export("tcp", src)
            times["tcp"].append(timed_import(rig.links["tcp"], handle, src, dst)[1])
        start = time.perf_counter()
        block_checksums(rig.reference, src)
        times["export_hash"].append(time.perf_counter() - start)
    gbps = {k: nbytes / statistics.median(times[k]) / 1e9 for k in (*BACKENDS, *COPIES)}
    paired = [c / p for c, p in zip(times["nixl_checked"], times["nixl"], strict=True)]
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
        nixl_merged_descriptors=merged_descriptors(src, dst),
        tcp_messages=tcp_read.descriptors,
        nixl_checked_gbps=nbytes / statistics.median(times["nixl_checked"]) / 1e9,
        checked_vs_plain=statistics.median(paired),
        verify_wait_ms=statistics.median(times["verify_wait"]) * 1e3,
        export_hash_ms=statistics.median(times["export_hash"]) * 1e3,
        verified={"nixl": nixl_ok, "tcp": tcp_ok, "nixl_checked": checked_ok},
        seconds=times,
    )


def measure_one_block(rig: TransferRig, name: str) -> OneBlockResult:
    """Fixed overhead: import (read + release) of one block, after a short warm-up."""
    src, dst = [rig.cfg.num_blocks - 1], [rig.cfg.num_blocks - 2]
    result, ok = verified_import(rig, name, src, dst)
    link, samples = rig.links[name], []
    for rep in range(ONE_BLOCK_WARMUP + rig.cfg.overhead_reps):
        handle = rig.peer.export(name, src)
        total = timed_import(link, handle, src, dst)[2]
        if rep >= ONE_BLOCK_WARMUP:
            samples.append(total * 1e3)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    median, mean = statistics.median(samples), statistics.fmean(samples)
    return OneBlockResult(
        name, result.bytes, result.descriptors, median, p99, mean, ok, len(samples)
    )


def measure_all(rig: TransferRig) -> tuple[list[CaseResult], list[OneBlockResult]]:
    """Connect every backend into the rig (the caller closes the links), then measure."""
    for name in BACKENDS:
        address = rig.peer.endpoints[name][0]
        rig.links[name] = connect(name, rig.layout, rig.pool, address, IMPORT_TIMEOUT_S)
    cases = []
    for tokens in rig.cfg.token_counts:
        for pattern in PATTERNS:
            case = measure_case(rig, tokens, pattern)
            progress(
                f"{tokens} tokens {pattern}: memcpy {case.memcpy_gbps:.2f}, nixl "
                f"{case.nixl_gbps:.2f}, tcp {case.tcp_gbps:.2f} GB/s"
            )
            cases.append(case)
    one_block = [measure_one_block(rig, name) for name in BACKENDS]
    return cases, one_block


def wait_leases_settled(peer: ExporterPeer) -> dict[str, LeaseCounts]:
    """NIXL releases arrive as notifications drained every few ms: wait for them."""
    end = time.monotonic() + 5.0
    counts, pinned = peer.leases()
    while (pinned or any(c.active for c in counts.values())) and time.monotonic() < end:
        time.sleep(0.02)
        counts, pinned = peer.leases()
    return counts
