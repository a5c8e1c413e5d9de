"""Engine benchmark: pdserve decode throughput against HF transformers, printed as ratios.

Lifecycle of one run (`python -m loadtest.engine.bench`):

1. Flags become the run's `RunSettings` and a frozen `EngineBenchConfig` naming one
   `PhasePlan` per batch size (`bench_main`; preset `short` by default, `--full` for a
   bigger one, `--smoke` for the tests' tiny one).
2. The default model is resolved (converted on first use) and, per phase, a seeded
   workload is drawn (`workload`).
3. The transformers model is loaded once per side that needs it, in the run's dtype
   (`--dtype`, default pdserve's `auto`). Then each phase runs every side back to back
   on the same requests (`sides`: pdserve, pdserve in float32 when the run's
   dtype is another, transformers static, transformers' continuous batching;
   interleaved by phase since this machine is shared and noisy), each after a short
   warm-up on other prompts; the ratios are held to the targets.
4. `bench_main` writes the report (`bench_report`: ratios, targets, the KV pool's size)
   to `--out` as JSON with the run's provenance and prints the table. The exit code is
   0 whether or not targets are met.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import torch

from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from engine.precision import DType, resolve_dtype
from engine.stats import EngineStats
from loadtest.engine.bench_config import EngineBenchConfig
from loadtest.engine.bench_report import (
    CB_TARGET,
    DTYPE_TARGETS,
    SCHEMA,
    TARGETS,
    EngineReport,
    PhaseResult,
    format_table,
    kv_info,
    machine_info,
)
from loadtest.engine.sides import (
    SideResult,
    agreement,
    load_hf_model,
    run_pdserve,
    run_transformers,
    run_transformers_cb,
)
from loadtest.engine.workload import PhasePlan, make_workload
from loadtest.harness.bench_main import Alias, BenchSpec, Progress, run_main
from loadtest.harness.bench_main import parse_args as parse_bench_args
from loadtest.harness.settings import RunSettings

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine",
    "loadtest/engine/bench.py",
    "loadtest/engine/bench_config.py",
    "loadtest/engine/bench_report.py",
    "loadtest/engine/sides.py",
    "loadtest/engine/workload.py",
)

progress = Progress("engine_bench")


@dataclass(frozen=True)
class HfModels:
    """The transformers models of a run: static `generate`, and the paged one for
    continuous batching (None when the run skips that side)."""

    static: Any
    paged: Any | None


def _verdict(ratio: float | None, target: float | None) -> bool | None:
    return None if ratio is None or target is None else ratio >= target


def _fp32_side(
    settings: RunSettings, cfg: EngineBenchConfig, plan: PhasePlan, requests: Any, vocab: int
) -> SideResult | None:
    if not cfg.fp32_baseline or resolve_dtype(cfg.dtype, torch.device("cpu")) == torch.float32:
        return None
    progress(f"batch {plan.batch_size}: pdserve in float32")
    side, _, _ = run_pdserve(settings, cfg, plan, requests, vocab, DType.FLOAT32)
    gc.collect()
    return side


def run_phase(
    settings: RunSettings, cfg: EngineBenchConfig, plan: PhasePlan, hf: HfModels, vocab_size: int
) -> tuple[PhaseResult, EngineStats]:
    requests = make_workload(plan, vocab_size, settings.seed)
    b = plan.batch_size
    load_before = os.getloadavg()[0]
    progress(f"batch {b}: pdserve, {len(requests)} requests")
    pd, pd_out, stats = run_pdserve(settings, cfg, plan, requests, vocab_size, cfg.dtype)
    gc.collect()
    progress(f"batch {b}: pdserve {pd.tokens_per_s:.1f} tok/s in {pd.wall_s:.1f}s")
    fp32 = _fp32_side(settings, cfg, plan, requests, vocab_size)
    progress(f"batch {b}: transformers")
    hf_side, hf_out = run_transformers(settings, cfg, hf.static, plan, requests, vocab_size)
    gc.collect()
    progress(f"batch {b}: transformers {hf_side.tokens_per_s:.1f} tok/s in {hf_side.wall_s:.1f}s")
    cb = None
    if hf.paged is not None:
        cb, _ = run_transformers_cb(settings, cfg, hf.paged, plan, requests, vocab_size)
        gc.collect()
        progress(f"batch {b}: transformers CB {cb.tokens_per_s:.1f} tok/s in {cb.wall_s:.1f}s")
    ratio = pd.tokens_per_s / hf_side.tokens_per_s
    cb_ratio = None if cb is None else pd.tokens_per_s / cb.tokens_per_s
    dtype_ratio = None if fp32 is None else pd.tokens_per_s / fp32.tokens_per_s
    target, dtype_target = TARGETS.get(b), DTYPE_TARGETS.get(b)
    result = PhaseResult(
        batch_size=b,
        num_requests=len(requests),
        prompt_tokens=pd.prompt_tokens,
        output_tokens=pd.output_tokens,
        pdserve=pd,
        transformers=hf_side,
        ratio=ratio,
        target=target,
        met=_verdict(ratio, target),
        greedy_agreement=agreement(pd_out, hf_out),
        transformers_cb=cb,
        cb_ratio=cb_ratio,
        cb_met=_verdict(cb_ratio, CB_TARGET),
        pdserve_fp32=fp32,
        dtype_ratio=dtype_ratio,
        dtype_target=None if dtype_ratio is None else dtype_target,
        dtype_met=_verdict(dtype_ratio, dtype_target),
        preemptions=stats.num_preemptions,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        load_before=load_before,
        load_after=os.getloadavg()[0],
    )
    return result, stats


def run(settings: RunSettings, cfg: EngineBenchConfig) -> EngineReport:
    """Run every phase in order and assemble the report (prints progress, not the table)."""
    started, t0 = datetime.now(UTC), time.perf_counter()
    # The report records the thread count the run used, not "torch's default".
    cfg = replace(cfg, threads=cfg.threads or torch.get_num_threads())
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model_dir(None, settings.model_cache_dir.expanduser(), progress=True)
    vocab_size = ModelSpec.from_dir(model_dir).vocab_size
    dtype = resolve_dtype(cfg.dtype, torch.device("cpu"))
    progress(f"preset {cfg.preset}, {cfg.threads} threads, {dtype}; loading transformers")
    hf = HfModels(
        static=load_hf_model(model_dir, dtype),
        paged=load_hf_model(model_dir, dtype, paged=True) if cfg.hf_continuous else None,
    )
    results: list[PhaseResult] = []
    stats: EngineStats | None = None
    for plan in cfg.phases:
        result, stats = run_phase(settings, cfg, plan, hf, vocab_size)
        results.append(result)
    assert stats is not None  # every preset has phases
    return EngineReport(
        schema=SCHEMA,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        wall_s=time.perf_counter() - t0,
        model_dir=str(model_dir),
        machine=machine_info(cfg.threads, dtype),
        settings=settings,
        config=cfg,
        kv=kv_info(stats),
        phases=results,
        targets_met=all(
            verdict is not False for p in results for verdict in (p.met, p.cb_met, p.dtype_met)
        ),
    )


SPEC = BenchSpec(
    name="engine",
    module="loadtest.engine.bench",
    description="pdserve vs transformers (static and continuous batching) and vs pdserve in "
    "float32: decode tokens/s at batch 1, 8 and 32, as ratios.",
    config=EngineBenchConfig,
    run=run,
    table=format_table,
    settings=("out", "seed", "model_cache_dir"),
    aliases=(
        Alias("--full", "preset", "full", "= --preset full: bigger workload (tens of minutes)"),
        Alias("--smoke", "preset", "smoke", "= --preset smoke: tiny workload for tests"),
        Alias("--no-warmup", "warmup", False, "= --warmup false: skip the untimed warm-ups"),
    ),
    measures=MEASURES,
)


def parse_args(argv: Sequence[str] | None = None) -> tuple[RunSettings, EngineBenchConfig]:
    return parse_bench_args(SPEC, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
