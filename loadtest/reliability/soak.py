"""The soak: thousands of requests at fixed concurrency with random client cancels, then
leak and memory accounting on every process.

Lifecycle: `run_soak(cluster, cfg)` drives `cfg.warmup` requests that are not counted,
then `cfg.requests` streams through the gateway with `cfg.concurrency` in flight; a
random `cfg.cancel_ratio` of them is cancelled by the client, before the first token or
after a few tokens. When half the requests are done it samples every process's resident
memory (VmRSS from /proc/<pid>/status: the gateway and each worker), and again after the
last one; then the leak probe (`loadtest.reliability.leak_probe`, its baseline taken
after the warmup) waits for the cluster to be idle and reads what is still held. The
`SoakReport` says how each request ended, which endings were unexpected (anything but a
finished stream, the client's own cancel, or a refusal by admission control, which
holds nothing; more than `max_refused_share` refused fails the soak, which is about the
served path), what leaked (blocks, requests and KV leases
per worker, load leases in Redis, the gateway's held stream slots, load leases, quota
charges, prefill leases and decode streams), how many exported KV and load leases ended
by expiry rather than a release (each one pinned blocks or load for its TTL), how much
each process grew over the second half, and the gateway's router counters (Redis errors,
releases Redis did not get at once, releases still owed), which tell a slow Redis from a
lost release. `Stranded` puts what was left as a rate: KV blocks, KV leases and load
leases held after the end per 1,000 aborted requests (target 0).

`python -m loadtest.reliability.soak` starts a local cluster (1 prefill + 1 decode
worker, Redis placement), runs the full soak, then the crash drill on the same cluster
(`crash_drill`: its decode worker killed under load, and the time until everything it
held elsewhere is back, against the KV lease TTL), and writes JSON
(bench-results/soak.json by default); its exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc

from loadtest.harness.target import TargetResult
from loadtest.reliability.crash_drill import (
    CrashDrill,
    CrashDrillConfig,
    drill_summary,
    run_crash_drill,
)
from loadtest.reliability.leak_probe import LeakProbe, Leaks, ProbeTarget
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result
from loadtest.reports.sources import SERVING_STACK
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.gateway.service import REFUSAL_REASON_KEY

# Shared openings (about two KV blocks each) so that the prefix cache and the router's
# affinity are exercised, each followed by a short unique tail.
_OPENINGS = (
    "You are a terse assistant. Answer with one short sentence and no preamble at all.",
    "Summarise the following note for a busy engineer who reads only the first line.",
    "Translate the next phrase into plain English, keeping the meaning and the tone.",
    "Continue the list below with one more item of the same kind and nothing else.",
)
_TOPICS = ("tides", "compilers", "bread", "glaciers", "chess", "rivers", "lamps", "owls")

SCHEMA = "pdserve.soak/1"
#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (*SERVING_STACK, "loadtest/reliability")


#: How a soak request may end: finished, cancelled by its client, or refused by
#: admission control (UNAVAILABLE / RESOURCE_EXHAUSTED with a refusal reason).
REFUSED = "refused"
EXPECTED = ("ok", "cancelled", REFUSED)


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    concurrency: int = 32
    cancel_ratio: float = 0.1
    max_tokens: int = 6  # completed requests ask for 1..max_tokens tokens
    warmup: int = 32
    seed: int = 0
    rss_growth_limit: float = 0.10
    clean_timeout_s: float = 10.0  # capped by the probe at half the shortest lease TTL
    # Admission may turn requests away under this load (a refusal holds nothing, which
    # the leak probe checks); past this share the soak did not soak the served path.
    max_refused_share: float = 0.1

    def __post_init__(self) -> None:
        if self.requests < 2 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("requests must be >= 2, concurrency and max_tokens >= 1")
        if not 0 <= self.cancel_ratio <= 1:
            raise ValueError(f"cancel_ratio must be in [0, 1], got {self.cancel_ratio}")


@dataclass(frozen=True)
class Stranded:
    """What the soak's requests left held once they had all ended (leases that ended by
    expiry count: each pinned its blocks or load for a TTL), against how many were
    aborted by their client."""

    aborted: int
    kv_blocks: int  # used on any worker
    kv_leases: int  # live on a prefill worker, or ended by expiry
    load_leases: int  # live in Redis, or purged as expired

    @classmethod
    def of(cls, leaks: Leaks, aborted: int) -> Stranded:
        held = leaks.workers.values()
        return cls(
            aborted,
            sum(w.get("used_blocks", 0) for w in held),
            sum(w.get("active_leases", 0) for w in held) + sum(leaks.expired_kv.values()),
            sum(leaks.load.values()) + sum(leaks.expired_load.values()),
        )

    def per_1000_aborted(self) -> dict[str, float]:
        """Each count per 1,000 aborted requests (target 0); 0 with none aborted."""
        scale = 1000 / self.aborted if self.aborted else 0.0
        return {
            "kv_blocks": self.kv_blocks * scale,
            "kv_leases": self.kv_leases * scale,
            "load_leases": self.load_leases * scale,
        }


@dataclass
class SoakReport:
    requests: int
    seconds: float
    outcomes: dict[str, int]  # "ok", "cancelled", or a gRPC status name
    unexpected: list[str]  # the first few unexpected endings, with their messages
    leaks: Leaks
    expired_kv_leases: int  # exported KV nobody released, unpinned only by its lease expiry
    rss_mid_kib: dict[str, int]
    rss_end_kib: dict[str, int]
    rss_growth: dict[str, float] = field(default_factory=dict)  # (end - mid) / mid
    rss_growth_limit: float = 0.10
    max_refused_share: float = 0.1
    # The gateway's router counters at the end (redis_errors, release_failures,
    # owed_releases): when leases leak, they say whether Redis was slow to answer.
    router: dict[str, float] = field(default_factory=dict)
    stranded: Stranded | None = None

    @property
    def passed(self) -> bool:
        grew = any(g >= self.rss_growth_limit for g in self.rss_growth.values())
        clean = self.leaks.clean and self.expired_kv_leases == 0
        served = self.outcomes.get(REFUSED, 0) <= self.max_refused_share * self.requests
        return not self.unexpected and clean and not grew and served

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["passed"] = self.passed
        out["unexpected_errors"] = sum(n for k, n in self.outcomes.items() if k not in EXPECTED)
        if self.stranded is not None:
            out["stranded_per_1000_aborted"] = self.stranded.per_1000_aborted()
        return out


# -- memory -------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    """Resident set size of a process (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cluster_rss(cluster: LocalCluster) -> dict[str, int]:
    return {c.name: rss_kib(c.proc.pid) for c in cluster.children if c.proc.poll() is None}


# -- the soak -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    prompt: str
    max_tokens: int
    cancel_after: int | None  # None: run to the end; 0: before the first token; n: after n
    cancel_delay_s: float


def _plan(rng: random.Random, cfg: SoakConfig) -> _Plan:
    prompt = f"{rng.choice(_OPENINGS)} Topic: {rng.choice(_TOPICS)} #{rng.randrange(10**6)}."
    if rng.random() >= cfg.cancel_ratio:
        return _Plan(prompt, rng.randint(1, cfg.max_tokens), None, 0.0)
    # Cancelled requests ask for many tokens so that the cancel lands mid-stream.
    return _Plan(prompt, 64, rng.choice((0, 1, 2, 4)), rng.uniform(0.0, 0.05))


async def _one(client: GatewayClient, plan: _Plan) -> tuple[str, str]:
    """("ok" | "cancelled" | status name, detail) of one request."""
    request = build_request(
        plan.prompt,
        RequestOptions(max_tokens=plan.max_tokens, ignore_eos=plan.cancel_after is not None),
    )
    call = client.generate(request, timeout=120.0)
    if plan.cancel_after == 0:
        await asyncio.sleep(plan.cancel_delay_s)
        call.cancel()
        return "cancelled", ""
    seen = 0
    try:
        async for msg in call:
            seen += 1
            if msg.finished:
                return "ok", ""
            if plan.cancel_after is not None and seen >= plan.cancel_after:
                call.cancel()
                return "cancelled", ""
    except grpc.aio.AioRpcError as exc:
        reason = dict(exc.trailing_metadata() or ()).get(REFUSAL_REASON_KEY)
        if reason:  # admission control said no, with a retry hint
            return REFUSED, str(reason)
        return exc.code().name, exc.details() or ""
    return "EOF", "the stream ended without a finished message"


async def _drive(
    client: GatewayClient, plans: list[_Plan], concurrency: int, on_half: asyncio.Event
) -> list[tuple[str, str]]:
    slots = asyncio.Semaphore(concurrency)
    done = 0

    async def run(plan: _Plan) -> tuple[str, str]:
        nonlocal done
        async with slots:
            result = await _one(client, plan)
        done += 1
        if done == len(plans) // 2:
            on_half.set()
        return result

    return list(await asyncio.gather(*(run(p) for p in plans)))


async def run_soak(cluster: LocalCluster, cfg: SoakConfig) -> SoakReport:
    rng = random.Random(cfg.seed)
    warm = [_plan(rng, replace(cfg, cancel_ratio=0.0)) for _ in range(cfg.warmup)]
    plans = [_plan(rng, cfg) for _ in range(cfg.requests)]
    half = asyncio.Event()
    rss_mid: dict[str, int] = {}

    async def sample_at_half() -> None:
        await half.wait()
        rss_mid.update(cluster_rss(cluster))

    async with GatewayClient(cluster.gateway_address) as client:
        await _drive(client, warm, cfg.concurrency, asyncio.Event())
        probe = await LeakProbe.start(ProbeTarget.local(cluster))
        start = time.monotonic()
        sampler = asyncio.create_task(sample_at_half())
        results = await _drive(client, plans, cfg.concurrency, half)
        seconds = time.monotonic() - start
        await sampler
    rss_end = cluster_rss(cluster)
    leaks = await probe.wait_clean(cfg.clean_timeout_s)
    expired = sum(leaks.expired_kv.values())
    outcomes = Counter(kind for kind, _ in results)
    unexpected = [f"{k}: {d}" for k, d in results if k not in EXPECTED][:10]
    growth = {n: (rss_end[n] - rss_mid[n]) / rss_mid[n] for n in rss_mid if n in rss_end}
    return SoakReport(
        cfg.requests, round(seconds, 2), dict(outcomes), unexpected, leaks, expired, rss_mid,
        rss_end, {n: round(g, 4) for n, g in growth.items()}, cfg.rss_growth_limit,
        cfg.max_refused_share,
        await asyncio.to_thread(router_counters, cluster),
        Stranded.of(leaks, outcomes.get("cancelled", 0)),
    )  # fmt: skip


ROUTER_COUNTERS = ("redis_errors_total", "release_failures_total", "owed_releases")


def router_counters(cluster: LocalCluster) -> dict[str, float]:
    """The gateway's embedded-router counters (empty if it serves no metrics)."""
    port = next((c.metrics_port for c in cluster.children if c.name == "gateway"), None)
    if port is None:
        return {}
    page = scrape(port)
    return {name: page.get(f"pdserve_router_{name}", 0.0) for name in ROUTER_COUNTERS}


def soak_cluster_config(**overrides: object) -> ClusterConfig:
    """The soak's cluster: 1 prefill + 1 decode worker, Redis placement, any free port."""
    settings: dict[str, object] = {"gateway_port": 0, "num_prefill": 1, "num_decode": 1,
                                   "http_port": -1}  # fmt: skip
    settings.update(overrides)
    return ClusterConfig(**settings)  # type: ignore[arg-type]


def summary(report: SoakReport) -> str:
    worst = max(report.rss_growth.items(), key=lambda kv: kv[1], default=("-", 0.0))
    stranded = report.stranded.per_1000_aborted() if report.stranded else {}
    return (
        f"soak: {report.requests} requests in {report.seconds:.0f} s, outcomes "
        f"{report.outcomes}, unexpected {len(report.unexpected)}, leaks "
        f"{'none' if report.leaks.clean else asdict(report.leaks)}, expired KV leases "
        f"{report.expired_kv_leases}, stranded per 1,000 aborted {stranded}, router "
        f"{report.router}, largest second-half RSS "
        f"growth {worst[0]} {100 * worst[1]:+.1f}% (limit {100 * report.rss_growth_limit:.0f}%)"
        f" -> {'PASS' if report.passed else 'FAIL'}"
    )


@dataclass(frozen=True)
class SoakResult:
    """The result file: the verdict, the report's counts, the crash drill and the run's
    config."""

    schema: str
    passed: bool  # the soak's checks and the drill's target
    report: dict[str, object]  # `SoakReport.to_json`
    crash_drill: CrashDrill
    config: dict[str, object]
    targets: list[TargetResult]


def soak_targets(report: SoakReport, drill: CrashDrill) -> list[TargetResult]:
    """Issue 45: nothing stranded per 1,000 aborted requests, and a crashed decode
    worker's holdings back within the KV lease TTL."""
    rates = report.stranded.per_1000_aborted() if report.stranded else {}
    targets = [
        TargetResult.check(f"{name.replace('_', ' ')} stranded per 1,000 aborted", rate, "<=", 0)
        for name, rate in rates.items()
    ]
    back = drill.bound_s if drill.returned_s is None else drill.returned_s
    targets.append(TargetResult.check(
        "decode crash: s until all it held is back", back, "<=", drill.kv_lease_ttl_s,
        f"{drill.expired_kv_leases} KV leases ended by expiry",
    ))  # fmt: skip
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    defaults = SoakConfig()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--cancel-ratio", type=float, default=defaults.cancel_ratio)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak.json"))
    args = parser.parse_args(argv)
    cfg = SoakConfig(
        requests=args.requests, concurrency=args.concurrency, cancel_ratio=args.cancel_ratio,
        max_tokens=args.max_tokens, seed=args.seed,
    )  # fmt: skip
    provenance = collect_provenance(measures=MEASURES)
    cluster = LocalCluster(soak_cluster_config())
    try:
        cluster.start()
        report = asyncio.run(run_soak(cluster, cfg))
        drill = asyncio.run(run_crash_drill(cluster, CrashDrillConfig()))
    finally:
        cluster.stop()
    print(summary(report))
    print(drill_summary(drill))
    passed = report.passed and drill.met
    result = SoakResult(
        SCHEMA, passed, report.to_json(), drill, asdict(cfg), soak_targets(report, drill)
    )
    write_result(args.out, result, provenance)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
