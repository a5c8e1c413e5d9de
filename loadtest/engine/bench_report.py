"""The engine benchmark's report: its shape (schema `pdserve.engine_bench/2`), the
targets, and the terminal table.

Lifecycle: `bench.run_phase` builds one `PhaseResult` per batch size (the ratio
pdserve / transformers static held to `TARGETS`, pdserve / transformers' continuous
batching to `CB_TARGET` at every batch size, and pdserve / pdserve in float32 to
`DTYPE_TARGETS`); `bench.run` collects them with the KV
pool's size (`kv_info`) and the library versions (`machine_info`) into an
`EngineReport`, which `bench_main` writes as JSON and prints with `format_table`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.stats import EngineStats
from loadtest.engine.bench_config import EngineBenchConfig
from loadtest.engine.sides import SideResult
from loadtest.harness.settings import RunSettings

SCHEMA = "pdserve.engine_bench/2"
#: pdserve / transformers static `generate`, decode tokens/s, at these batch sizes.
TARGETS: dict[int, float] = {1: 0.9, 32: 3.0}
#: pdserve / transformers' continuous batching in the same dtype, at every batch size.
CB_TARGET = 3.0
#: pdserve in the run's dtype / pdserve in float32, same requests, at these batch sizes.
DTYPE_TARGETS: dict[int, float] = {32: 2.5}


@dataclass(frozen=True)
class PhaseResult:
    batch_size: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    pdserve: SideResult
    transformers: SideResult
    ratio: float
    target: float | None
    met: bool | None
    greedy_agreement: float
    #: transformers' continuous batching (None when the run skipped it) and the ratio.
    transformers_cb: SideResult | None
    cb_ratio: float | None
    cb_met: bool | None
    #: pdserve in float32 on the same requests (None when the run is float32 or skipped it).
    pdserve_fp32: SideResult | None
    dtype_ratio: float | None
    dtype_target: float | None
    dtype_met: bool | None
    preemptions: int
    prefix_hit_tokens: int
    #: 1-minute load average before and after the phase: context on a shared machine.
    load_before: float
    load_after: float


@dataclass(frozen=True)
class KvInfo:
    bytes_per_token: int
    block_size: int
    total_blocks: int
    pool_tokens: int
    pool_bytes: int
    pool_mib: float


@dataclass(frozen=True)
class MachineInfo:
    """What ran the sides (the host itself is in the result's provenance)."""

    torch_threads: int
    dtype: str  # what pdserve and transformers computed in
    torch_version: str
    transformers_version: str


@dataclass(frozen=True)
class EngineReport:
    schema: str
    started_at: str
    finished_at: str
    wall_s: float
    model_dir: str
    machine: MachineInfo
    settings: RunSettings
    config: EngineBenchConfig
    kv: KvInfo
    phases: list[PhaseResult]
    targets_met: bool


def kv_info(stats: EngineStats) -> KvInfo:
    return KvInfo(
        bytes_per_token=stats.kv_bytes_per_token,
        block_size=stats.block_size,
        total_blocks=stats.total_blocks,
        pool_tokens=stats.total_blocks * stats.block_size,
        pool_bytes=stats.kv_pool_bytes,
        pool_mib=stats.kv_pool_bytes / 2**20,
    )


def machine_info(threads: int, dtype: torch.dtype) -> MachineInfo:
    try:
        import transformers

        hf_version = str(transformers.__version__)
    except ImportError:
        hf_version = "not installed"
    return MachineInfo(
        torch_threads=threads,
        dtype=str(dtype).removeprefix("torch."),
        torch_version=torch.__version__,
        transformers_version=hf_version,
    )


def _ratio(value: float | None, target: float | None = None) -> str:
    if value is None:
        return "-"
    verdict = "" if target is None else (" ok" if value >= target else " UNMET")
    return f"{value:.2f}x{verdict}"


def format_table(report: EngineReport) -> str:
    rows = [
        f"{'batch':>5}  {'reqs':>4}  {'pdserve tok/s':>13}  {'transformers tok/s':>18}  "
        f"{'ratio':>7}  {'target':>7}  {'result':<6}  {'vs HF CB':>11}  {'vs fp32':>11}  load"
    ]
    for p in report.phases:
        target = f">={p.target:.2f}x" if p.target is not None else "-"
        verdict = "-" if p.met is None else ("met" if p.met else "UNMET")
        cb_target = CB_TARGET if p.cb_ratio is not None else None
        rows.append(
            f"{p.batch_size:>5}  {p.num_requests:>4}  {p.pdserve.tokens_per_s:>13.1f}  "
            f"{p.transformers.tokens_per_s:>18.1f}  {p.ratio:>6.2f}x  {target:>7}  {verdict:<6}  "
            f"{_ratio(p.cb_ratio, cb_target):>11}  {_ratio(p.dtype_ratio, p.dtype_target):>11}  "
            f"{p.load_before:.1f}-{p.load_after:.1f}"
        )
    kv = report.kv
    rows.append(
        f"KV: {kv.bytes_per_token} bytes/token ({kv.bytes_per_token / 1024:.1f} KiB); pool "
        f"{kv.total_blocks} blocks x {kv.block_size} = {kv.pool_tokens} tokens, "
        f"{kv.pool_mib:.1f} MiB"
    )
    rows.append(
        f"preset {report.config.preset}, {report.machine.dtype}, "
        f"{report.machine.torch_threads} torch threads; "
        f"load = 1-min load average before-after each phase; wall {report.wall_s:.0f}s; "
        f"all targets met: {report.targets_met}"
    )
    return "\n".join(rows)
