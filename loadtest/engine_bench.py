"""Engine benchmark: pdserve decode throughput against HF transformers, printed as ratios.

Lifecycle of one run:

1. Flags become a frozen `BenchConfig` holding one `PhasePlan` per batch size (preset
   `short` by default, `--full` for a bigger one, `--smoke` for the tests' tiny one).
2. The default model is resolved (converted on first use) and, per phase, a seeded workload
   is drawn: prompts of random regular token ids, prompt and output lengths log-uniform in
   the plan's ranges (16-1,024 and 16-256 tokens, as in real traffic). Random ids keep
   prompts from sharing prefixes, so pdserve's prefix cache gets no hits it would not get
   in real traffic; throughput depends only on the lengths.
3. The transformers model is loaded once. Then each phase runs both sides back to back on
   the same requests (interleaved, since this machine is shared and noisy), each after a
   short warm-up on other prompts:
   - pdserve at batch B: a fresh `LLMEngine` with `max_num_seqs=B`, every request
     submitted at once, stepped until done (continuous batching keeps B running);
   - transformers at batch B: consecutive static batches of B requests, left-padded with
     an attention mask, greedy `generate` run to the batch's longest output.
   Both are greedy and ignore EOS, so each request gets exactly its requested tokens.
   Throughput = the requests' own requested output tokens / wall seconds, prefill
   included: a static batch's padding and over-generation are its honest cost.
4. A table of ratios against the targets and the KV pool's size is printed, and every
   number goes to `--out` as JSON. The exit code is 0 whether or not targets are met.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import DEFAULT_MODEL_CACHE, EngineConfig
from engine.engine import LLMEngine
from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

SCHEMA = "pdserve.engine_bench/1"
#: SmolLM2's pad id (= its EOS); left padding never reaches a sampled position.
PAD_ID = 2
#: Ids below this are SmolLM2's special tokens; prompts draw only regular ones.
FIRST_REGULAR_ID = 17
#: The issue's targets: pdserve / transformers decode tokens/s at these batch sizes.
TARGETS: dict[int, float] = {1: 0.9, 32: 3.0}
#: Tokens compared when reporting how often both sides produced the same greedy output.
AGREEMENT_PREFIX = 8
WARMUP_PROMPT_LEN = 24
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class PhasePlan:
    """One batch size's workload: how many requests and their length ranges (inclusive)."""

    batch_size: int
    num_requests: int
    prompt_range: tuple[int, int] = (16, 1024)
    output_range: tuple[int, int] = (16, 256)

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.num_requests < self.batch_size:
            raise ValueError(f"need num_requests >= batch_size > 0, got {self}")
        for lo, hi in (self.prompt_range, self.output_range):
            if not 0 < lo <= hi:
                raise ValueError(f"length ranges need 0 < lo <= hi, got {self}")


PRESETS: dict[str, tuple[PhasePlan, ...]] = {
    # Batch 1 runs fewer and shorter requests (the same log-uniform shape, both bounds
    # halved) so that the default run fits in a few minutes on two cores.
    "short": (
        PhasePlan(1, 3, (8, 512), (8, 128)),
        PhasePlan(8, 8),
        PhasePlan(32, 32),
    ),
    "full": (
        PhasePlan(1, 8),
        PhasePlan(8, 32),
        PhasePlan(32, 96),
    ),
    "smoke": (
        PhasePlan(1, 2, (16, 40), (4, 8)),
        PhasePlan(2, 2, (16, 40), (4, 8)),
    ),
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run depends on; recorded verbatim in the JSON."""

    preset: str
    phases: tuple[PhasePlan, ...]
    model_cache_dir: Path = DEFAULT_MODEL_CACHE
    out: Path = Path("bench-results/engine.json")
    seed: int = 0
    threads: int = field(default_factory=torch.get_num_threads)
    kv_cache_bytes: int = 2 << 30
    max_num_batched_tokens: int = 512
    warmup: bool = True

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("need at least one phase")
        if self.threads <= 0:
            raise ValueError(f"threads must be > 0, got {self.threads}")
        if self.kv_cache_bytes <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("kv_cache_bytes and max_num_batched_tokens must be > 0")


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class SideResult:
    """One side's timed run of a phase.

    `output_tokens` counts only each request's own requested tokens (the useful ones);
    `computed_tokens` counts every position the model ran, padding and overrun included.
    """

    wall_s: float
    output_tokens: int
    prompt_tokens: int
    computed_tokens: int
    forward_passes: int
    tokens_per_s: float
    total_tokens_per_s: float


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
    cpu_count: int
    torch_threads: int
    torch_version: str
    transformers_version: str
    python: str
    platform: str
    processor: str


@dataclass(frozen=True)
class BenchReport:
    schema: str
    started_at: str
    finished_at: str
    wall_s: float
    model_dir: str
    machine: MachineInfo
    config: BenchConfig
    kv: KvInfo
    phases: list[PhaseResult]
    targets_met: bool


# -- workload -------------------------------------------------------------------------
def log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> list[int]:
    """`n` integers in [lo, hi] whose logarithm is (about) uniformly distributed."""
    draws = np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n))
    return [min(hi, max(lo, int(v))) for v in draws]


def make_workload(plan: PhasePlan, vocab_size: int, seed: int) -> list[BenchRequest]:
    """The phase's requests, the same for any run with the same seed and plan."""
    rng = np.random.default_rng([seed, plan.batch_size, plan.num_requests])
    prompt_lens = log_uniform(rng, *plan.prompt_range, plan.num_requests)
    output_lens = log_uniform(rng, *plan.output_range, plan.num_requests)
    return [
        BenchRequest(tuple(int(t) for t in rng.integers(FIRST_REGULAR_ID, vocab_size, p)), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def warmup_workload(n: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng([seed, 0xC0FFEE, n])
    return [
        BenchRequest(
            tuple(int(t) for t in rng.integers(FIRST_REGULAR_ID, vocab_size, WARMUP_PROMPT_LEN)),
            WARMUP_OUTPUT_LEN,
        )
        for _ in range(n)
    ]


def side_result(
    wall_s: float, requests: Sequence[BenchRequest], computed: int, passes: int
) -> SideResult:
    out = sum(r.max_tokens for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    return SideResult(
        wall_s=wall_s,
        output_tokens=out,
        prompt_tokens=prompt,
        computed_tokens=computed,
        forward_passes=passes,
        tokens_per_s=out / wall_s,
        total_tokens_per_s=(out + prompt) / wall_s,
    )


# -- pdserve --------------------------------------------------------------------------
def build_engine(cfg: BenchConfig, batch_size: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_cache_dir=cfg.model_cache_dir.expanduser(),
            kv_cache_bytes=cfg.kv_cache_bytes,
            max_num_seqs=batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_threads=cfg.threads,
        )
    )


def drive_engine(eng: LLMEngine, requests: Sequence[BenchRequest]) -> tuple[list[list[int]], int]:
    """Submit every request at once and step until all finish; returns outputs and steps."""
    ids = [
        eng.add_request(
            list(r.prompt),
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
        )
        for r in requests
    ]
    produced: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            produced[out.request_id].extend(out.new_token_ids)
        steps += 1
    return [produced[rid] for rid in ids], steps


def run_pdserve(
    cfg: BenchConfig, plan: PhasePlan, requests: Sequence[BenchRequest], vocab_size: int
) -> tuple[SideResult, list[list[int]], EngineStats]:
    """Time pdserve on the phase; raises if a request got other than its requested tokens."""
    eng = build_engine(cfg, plan.batch_size)
    if cfg.warmup:
        drive_engine(eng, warmup_workload(min(plan.batch_size, 2), vocab_size, cfg.seed))
    start = time.perf_counter()
    outputs, steps = drive_engine(eng, requests)
    wall = time.perf_counter() - start
    stats = eng.stats()
    for r, out in zip(requests, outputs, strict=True):
        if len(out) != r.max_tokens:
            raise RuntimeError(f"pdserve produced {len(out)} tokens, {r.max_tokens} requested")
    if stats.used_blocks or stats.running or stats.waiting:
        raise RuntimeError(f"pdserve left work or blocks behind: {stats}")
    computed = sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    return side_result(wall, requests, computed, steps), outputs, stats


# -- transformers ---------------------------------------------------------------------
def load_hf_model(model_dir: Path) -> Any:
    """The reference model, fp32 like pdserve on CPU (transformers is a test extra)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_static_batch(model: Any, batch: Sequence[BenchRequest]) -> tuple[list[list[int]], int]:
    """Generate one left-padded static batch to its longest output; returns outputs, steps."""
    width = max(len(r.prompt) for r in batch)
    steps = max(r.max_tokens for r in batch)
    ids = torch.tensor([[PAD_ID] * (width - len(r.prompt)) + list(r.prompt) for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    with torch.inference_mode():
        # min_new_tokens = max_new_tokens: EOS cannot end a row early, like ignore_eos.
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
    if out.shape[1] != width + steps:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} of {steps} tokens")
    new = out[:, width:].tolist()
    return [row[: r.max_tokens] for row, r in zip(new, batch, strict=True)], steps


def run_transformers(
    cfg: BenchConfig,
    model: Any,
    plan: PhasePlan,
    requests: Sequence[BenchRequest],
    vocab_size: int,
) -> tuple[SideResult, list[list[int]]]:
    """Time transformers on the phase in consecutive static batches of `batch_size`."""
    if cfg.warmup:
        hf_static_batch(model, warmup_workload(min(plan.batch_size, 2), vocab_size, cfg.seed))
    b = plan.batch_size
    batches = [requests[i : i + b] for i in range(0, len(requests), b)]
    outputs: list[list[int]] = []
    computed = passes = 0
    start = time.perf_counter()
    for batch in batches:
        out, steps = hf_static_batch(model, batch)
        outputs.extend(out)
        computed += len(batch) * (max(len(r.prompt) for r in batch) + steps - 1)
        passes += steps
    wall = time.perf_counter() - start
    return side_result(wall, requests, computed, passes), outputs


# -- one phase ------------------------------------------------------------------------
def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Fraction of requests whose first few greedy tokens match on both sides."""
    same = sum(x[:AGREEMENT_PREFIX] == y[:AGREEMENT_PREFIX] for x, y in zip(a, b, strict=True))
    return same / len(a)


def run_phase(
    cfg: BenchConfig, plan: PhasePlan, hf_model: Any, vocab_size: int
) -> tuple[PhaseResult, EngineStats]:
    requests = make_workload(plan, vocab_size, cfg.seed)
    b = plan.batch_size
    load_before = os.getloadavg()[0]
    progress(f"batch {b}: pdserve, {len(requests)} requests")
    pd, pd_out, stats = run_pdserve(cfg, plan, requests, vocab_size)
    gc.collect()
    progress(f"batch {b}: pdserve {pd.tokens_per_s:.1f} tok/s in {pd.wall_s:.1f}s; transformers")
    hf, hf_out = run_transformers(cfg, hf_model, plan, requests, vocab_size)
    gc.collect()
    progress(f"batch {b}: transformers {hf.tokens_per_s:.1f} tok/s in {hf.wall_s:.1f}s")
    ratio = pd.tokens_per_s / hf.tokens_per_s
    target = TARGETS.get(b)
    result = PhaseResult(
        batch_size=b,
        num_requests=len(requests),
        prompt_tokens=pd.prompt_tokens,
        output_tokens=pd.output_tokens,
        pdserve=pd,
        transformers=hf,
        ratio=ratio,
        target=target,
        met=None if target is None else ratio >= target,
        greedy_agreement=agreement(pd_out, hf_out),
        preemptions=stats.num_preemptions,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        load_before=load_before,
        load_after=os.getloadavg()[0],
    )
    return result, stats


# -- reporting ------------------------------------------------------------------------
def progress(message: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def kv_info(stats: EngineStats) -> KvInfo:
    return KvInfo(
        bytes_per_token=stats.kv_bytes_per_token,
        block_size=stats.block_size,
        total_blocks=stats.total_blocks,
        pool_tokens=stats.total_blocks * stats.block_size,
        pool_bytes=stats.kv_pool_bytes,
        pool_mib=stats.kv_pool_bytes / 2**20,
    )


def machine_info(threads: int) -> MachineInfo:
    try:
        import transformers

        hf_version = str(transformers.__version__)
    except ImportError:
        hf_version = "not installed"
    return MachineInfo(
        cpu_count=os.cpu_count() or 0,
        torch_threads=threads,
        torch_version=torch.__version__,
        transformers_version=hf_version,
        python=platform.python_version(),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
    )


def format_table(report: BenchReport) -> str:
    rows = [
        f"{'batch':>5}  {'reqs':>4}  {'pdserve tok/s':>13}  {'transformers tok/s':>18}  "
        f"{'ratio':>7}  {'target':>7}  {'result':<6}  load"
    ]
    for p in report.phases:
        target = f">={p.target:.2f}x" if p.target is not None else "-"
        verdict = "-" if p.met is None else ("met" if p.met else "UNMET")
        rows.append(
            f"{p.batch_size:>5}  {p.num_requests:>4}  {p.pdserve.tokens_per_s:>13.1f}  "
            f"{p.transformers.tokens_per_s:>18.1f}  {p.ratio:>6.2f}x  {target:>7}  {verdict:<6}  "
            f"{p.load_before:.1f}-{p.load_after:.1f}"
        )
    kv = report.kv
    rows.append(
        f"KV: {kv.bytes_per_token} bytes/token ({kv.bytes_per_token / 1024:.1f} KiB); pool "
        f"{kv.total_blocks} blocks x {kv.block_size} = {kv.pool_tokens} tokens, "
        f"{kv.pool_mib:.1f} MiB"
    )
    rows.append(
        f"threads {report.machine.torch_threads} of {report.machine.cpu_count} CPUs; "
        f"load = 1-min load average before-after each phase; wall {report.wall_s:.0f}s; "
        f"all targets met: {report.targets_met}"
    )
    return "\n".join(rows)


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n", encoding="utf-8")


# -- entry point ----------------------------------------------------------------------
def run(cfg: BenchConfig) -> BenchReport:
    """Run every phase in order and assemble the report (prints progress, not the table)."""
    started, t0 = datetime.now(UTC), time.perf_counter()
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model_dir(None, cfg.model_cache_dir.expanduser(), progress=True)
    vocab_size = ModelSpec.from_dir(model_dir).vocab_size
    progress(f"preset {cfg.preset}, {cfg.threads} threads; loading transformers model")
    hf_model = load_hf_model(model_dir)
    results: list[PhaseResult] = []
    stats: EngineStats | None = None
    for plan in cfg.phases:
        result, stats = run_phase(cfg, plan, hf_model, vocab_size)
        results.append(result)
    assert stats is not None  # phases is never empty (BenchConfig checks)
    return BenchReport(
        schema=SCHEMA,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        wall_s=time.perf_counter() - t0,
        model_dir=str(model_dir),
        machine=machine_info(cfg.threads),
        config=cfg,
        kv=kv_info(stats),
        phases=results,
        targets_met=all(p.met is not False for p in results),
    )


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.engine_bench",
        description="pdserve vs transformers decode tokens/s at batch 1, 8 and 32, as ratios.",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="bigger workload (tens of minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny workload for tests")
    p.add_argument("--model-cache-dir", type=Path, default=DEFAULT_MODEL_CACHE)
    p.add_argument("--out", type=Path, default=Path("bench-results/engine.json"))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    a = p.parse_args(argv)
    preset = "full" if a.full else "smoke" if a.smoke else "short"
    return BenchConfig(
        preset=preset,
        phases=PRESETS[preset],
        model_cache_dir=a.model_cache_dir,
        out=a.out,
        seed=a.seed,
        threads=a.threads,
        kv_cache_bytes=a.kv_cache_bytes,
        max_num_batched_tokens=a.max_num_batched_tokens,
        warmup=not a.no_warmup,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    report = run(cfg)
    write_json(report, cfg.out)
    print(format_table(report))
    print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
