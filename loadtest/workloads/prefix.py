"""A multi-tenant chat workload and a per-worker prefix-cache simulation, for router benches.

Lifecycle:

1. `make_workload(WorkloadConfig)` draws T tenants x P system prompts (random token ids,
   lengths uniform in `system_tokens`), ranks the (tenant, prompt) pairs in a random
   order, and draws `requests` requests whose system prompt follows Zipf(s) over those
   ranks; each request is its system prompt plus a unique user suffix. Each request's
   chained full-block hashes are computed once with the engine's `prefix_block_hashes`,
   seeded with (model, tenant) exactly as the engine's prefix cache and the router seed
   them, so a block hit here is a block hit in an engine.
2. `run_policy(workload, SimConfig, placer)` replays the requests in order through a
   `Placer` (the real Router in `loadtest.router.bench`, or `OraclePlacer`) with a sliding window
   of W in-flight requests: once W are in flight the oldest is released before the next
   placement, so every request holds its load lease for W decisions and the bound binds.
3. `ClusterSim` keeps one LRU `PrefixCache` of C blocks per worker. A placement's hit is
   the longest run of leading blocks that worker holds; the request's blocks then become
   the most recent ones, head last, so a prefix's tail is evicted before its head (the
   engine's block pool frees a sequence tail first for the same reason). Every full block
   is cached, the unique suffix's too, as in an engine, so one-off blocks compete with the
   shared ones. Simplification: blocks enter the cache at placement, and the capacity
   counts cached blocks only (no blocks held by running requests).
4. Statistics skip the first `warmup` requests (cold caches, a filling window): prefix hit
   ratio = hit tokens / prompt tokens; at each decision, max/avg of the in-flight loads.

`summarize` adds the references, on the same sequence and caches: `upper_bound_hit_ratio`,
a true upper bound for any policy (one unlimited cache that has seen every earlier
request); `OraclePlacer()`, the issue's oracle (greedy and cache-aware, ignoring load; not
a proven optimum, which is why policies are also shown against the upper bound); and
`OraclePlacer(eps)`, the same held to the router's load bound, which says how much of a
policy's gap to the oracle is the price of the bound itself.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine.prefix_hash import hash_seed, prefix_block_hashes
from services.router.load import load_bound


@dataclass(frozen=True)
class WorkloadConfig:
    tenants: int = 20
    prompts_per_tenant: int = 5
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (64, 256)  # inclusive range of system prompt lengths
    suffix_tokens: tuple[int, int] = (16, 96)  # inclusive range of user suffix lengths
    requests: int = 12000
    block_size: int = 16
    vocab_size: int = 32000
    model: str = "bench-model"  # model fingerprint: part of every hash seed
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.prompts_per_tenant < 1 or self.requests < 1:
            raise ValueError("tenants, prompts_per_tenant and requests must be >= 1")
        if self.zipf_s <= 0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s}")
        for name in ("system_tokens", "suffix_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.block_size < 1 or self.vocab_size < 2:
            raise ValueError("block_size must be >= 1 and vocab_size >= 2")

    @property
    def system_prompts(self) -> int:
        return self.tenants * self.prompts_per_tenant


@dataclass(frozen=True)
class ChatRequest:
    request_id: str
    tenant: str
    rank: int  # popularity rank of its system prompt (0 = most popular)
    tokens: tuple[int, ...]
    block_hashes: tuple[int, ...]  # chained hashes of its full blocks, tenant-salted


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    requests: tuple[ChatRequest, ...]
    system_blocks: tuple[int, ...]  # full blocks of each system prompt, by rank

    @property
    def hot_blocks(self) -> int:
        """Blocks of all system prompts together: the shared working set."""
        return sum(self.system_blocks)


def zipf_weights(n: int, s: float) -> list[float]:
    """Unnormalised Zipf(s) weights of ranks 1..n."""
    return [1.0 / k**s for k in range(1, n + 1)]


class ZipfSampler:
    """Draws ranks 0..n-1 with P(rank r) proportional to 1 / (r + 1)**s (the load tester's
    system-prompt popularity; `make_workload` draws its ranks the same way, in bulk)."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1 or s <= 0:
            raise ValueError(f"need n >= 1 and s > 0, got n={n}, s={s}")
        self.n = n
        self._cum = list(itertools.accumulate(zipf_weights(n, s)))

    def probability(self, rank: int) -> float:
        previous = self._cum[rank - 1] if rank else 0.0
        return (self._cum[rank] - previous) / self._cum[-1]

    def sample(self, rng: random.Random) -> int:
        return rng.choices(range(self.n), cum_weights=self._cum, k=1)[0]


def make_workload(cfg: WorkloadConfig) -> Workload:
    """Draw the system prompts and the request sequence; deterministic in `cfg.seed`."""
    rng = random.Random(cfg.seed)
    pairs = [
        (f"tenant-{t:02d}", p) for t in range(cfg.tenants) for p in range(cfg.prompts_per_tenant)
    ]
    rng.shuffle(pairs)  # rank r is pairs[r]: popular prompts spread over the tenants
    systems = [_tokens(rng, cfg, rng.randint(*cfg.system_tokens)) for _ in pairs]
    cum = list(itertools.accumulate(zipf_weights(len(pairs), cfg.zipf_s)))
    ranks = rng.choices(range(len(pairs)), cum_weights=cum, k=cfg.requests)
    seeds = {tenant: hash_seed(cfg.model, tenant) for tenant, _ in pairs}
    requests = []
    for i, rank in enumerate(ranks):
        tenant = pairs[rank][0]
        tokens = systems[rank] + _tokens(rng, cfg, rng.randint(*cfg.suffix_tokens))
        hashes = prefix_block_hashes(tokens, cfg.block_size, seeds[tenant])
        requests.append(ChatRequest(f"req-{i}", tenant, rank, tokens, tuple(hashes)))
    blocks = tuple(len(s) // cfg.block_size for s in systems)
    return Workload(cfg, tuple(requests), blocks)


def _tokens(rng: random.Random, cfg: WorkloadConfig, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, cfg.vocab_size) for _ in range(n))


class PrefixCache:
    """An LRU set of block hashes with a fixed capacity (one worker's prefix cache), and
    optionally an offload tier of `tier` more: blocks the pool evicts move there, a hit
    in either counts, and an admitted block moves back to the pool (as the engine's
    `OffloadTier` copies it back)."""

    def __init__(self, capacity: int, tier: int = 0) -> None:
        if capacity < 1 or tier < 0:
            raise ValueError(f"need capacity >= 1 and tier >= 0, got {capacity}, {tier}")
        self.capacity = capacity
        self.tier_capacity = tier
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._tier: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru) + len(self._tier)

    def blocks(self) -> frozenset[int]:
        """Every block held, pool and tier: what a worker reports to the router."""
        return frozenset(self._lru) | frozenset(self._tier)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached in either tier. No side effects."""
        n = 0
        for h in hashes:
            if h not in self._lru and h not in self._tier:
                break
            n += 1
        return n

    def admit(self, hashes: Sequence[int]) -> None:
        """Make `hashes` the most recent entries, head last; evict the least recent (into
        the tier, whose own least recent are dropped)."""
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._tier.pop(h, None)
                self._lru[h] = None
        while len(self._lru) > self.capacity:
            evicted, _ = self._lru.popitem(last=False)
            if self.tier_capacity:
                self._tier[evicted] = None
        while len(self._tier) > self.tier_capacity:
            self._tier.popitem(last=False)


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    capacity_blocks: int = 192  # per worker
    window: int = 64  # requests in flight (each holds one load lease)
    warmup: int = 1000  # leading requests left out of the statistics
    tier_blocks: int = 0  # per worker: an offload tier behind the cache (0: none)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.capacity_blocks < 1 or self.window < 1:
            raise ValueError("workers, capacity_blocks and window must be >= 1")
        if self.warmup < self.window:
            raise ValueError("warmup must be >= window, so statistics see a full window")


class ClusterSim:
    """The workers' prefix caches and in-flight loads, as a placement sequence leaves them."""

    def __init__(self, cfg: SimConfig) -> None:
        self.caches = [
            PrefixCache(cfg.capacity_blocks, cfg.tier_blocks) for _ in range(cfg.workers)
        ]
        self.loads = [0] * cfg.workers

    def place(self, worker: int, request: ChatRequest) -> int:
        """Serve `request` on `worker`: returns its hit blocks, then caches its blocks."""
        cache = self.caches[worker]
        hit = cache.match(request.block_hashes)
        cache.admit(request.block_hashes)
        self.loads[worker] += 1
        return hit

    def release(self, worker: int) -> None:
        self.loads[worker] -= 1


class Placer(Protocol):
    name: str

    def place(self, request: ChatRequest, sim: ClusterSim) -> tuple[int, tuple[str, ...]]:
        """The worker index for `request` and the load leases `release` gives back later.
        May read `sim` (the oracle does) but must not change it."""
        ...

    def release(self, leases: tuple[str, ...]) -> None:
        """Give back the leases of one placement."""
        ...


class OraclePlacer:
    """Greedy cache-aware reference: the worker holding the longest cached prefix of the
    request (ties: least in-flight load, then lowest index). With `eps` None it ignores
    load (the issue's oracle); with `eps` it only considers workers below the router's
    bound, ceil((1 + eps) * (total + 1) / n): the best greedy choice under the same cap."""

    def __init__(self, eps: float | None = None) -> None:
        self.eps = eps
        self.name = "oracle" if eps is None else "oracle_bounded"

    def place(self, request: ChatRequest, sim: ClusterSim) -> tuple[int, tuple[str, ...]]:
        hashes, loads = request.block_hashes, sim.loads
        candidates = list(range(len(loads)))
        if self.eps is not None:
            # Never empty: the average load is below the bound, so the least loaded is too.
            bound = load_bound(sum(loads), len(loads), self.eps)
            candidates = [w for w in candidates if loads[w] < bound]
        best = max(candidates, key=lambda w: (sim.caches[w].match(hashes), -loads[w], -w))
        return best, ()

    def release(self, leases: tuple[str, ...]) -> None:
        return None


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    measured_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_ratio: float  # hit tokens / prompt tokens
    load_max_over_avg_peak: float  # worst decision: max in-flight load / average
    load_max_over_avg_mean: float  # the same, averaged over decisions
    requests_max_over_avg: float  # requests served by the busiest worker / average
    wall_s: float
    vs_oracle: float = 0.0  # hit_ratio / the oracle's (filled in by the bench)
    overflow: float = 0.0  # share of router picks not first in the policy's order (the
    # ring walk for bounded / consistent / least_loaded: requests moved off their key)
    fail_open: int = 0  # router placements made without Redis (must be 0)
    leases_left: int = 0  # load leases still in Redis after every release (must be 0)


def run_policy(
    workload: Workload,
    cfg: SimConfig,
    placer: Placer,
    before: Callable[[int, ClusterSim], None] | None = None,
) -> PolicyResult:
    """Replay the workload through `placer` (see the module docstring); releases all.
    `before(i, sim)`, if given, runs before request i is placed: it may change the
    simulated caches (a worker restarting empty) or report them."""
    sim = ClusterSim(cfg)
    inflight: deque[tuple[int, tuple[str, ...]]] = deque()
    hit_tokens = prompt_tokens = 0
    ratios: list[float] = []  # max/avg in-flight load after each measured decision
    served = [0] * cfg.workers  # measured requests per worker
    t0 = time.perf_counter()
    try:
        for i, request in enumerate(workload.requests):
            if len(inflight) >= cfg.window:
                worker, leases = inflight.popleft()
                placer.release(leases)
                sim.release(worker)
            if before is not None:
                before(i, sim)
            worker, leases = placer.place(request, sim)
            hit = sim.place(worker, request)
            inflight.append((worker, leases))
            if i >= cfg.warmup:
                served[worker] += 1
                hit_tokens += hit * workload.config.block_size
                prompt_tokens += len(request.tokens)
                ratios.append(max(sim.loads) * cfg.workers / sum(sim.loads))
    finally:
        while inflight:
            placer.release(inflight.popleft()[1])
    n = max(1, len(ratios))
    return PolicyResult(
        policy=placer.name,
        measured_requests=len(ratios),
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        hit_ratio=hit_tokens / max(1, prompt_tokens),
        load_max_over_avg_peak=max(ratios, default=0.0),
        load_max_over_avg_mean=sum(ratios) / n,
        requests_max_over_avg=max(served) * cfg.workers / n,
        wall_s=time.perf_counter() - t0,
    )


def upper_bound_hit_ratio(workload: Workload, warmup: int) -> float:
    """Hit ratio of one unlimited cache that has seen every earlier request: no policy
    with any capacity can hit more, since a worker only caches what earlier requests sent."""
    seen: set[int] = set()
    hit = total = 0
    for i, request in enumerate(workload.requests):
        n = 0
        for h in request.block_hashes:
            if h not in seen:
                break
            n += 1
        seen.update(request.block_hashes)
        if i >= warmup:
            hit += n * workload.config.block_size
            total += len(request.tokens)
    return hit / max(1, total)


@dataclass(frozen=True)
class HitRateResult:
    workers: int
    capacity_blocks_per_worker: int
    hot_blocks: int  # blocks of all system prompts together
    cache_vs_hot: float  # all workers' cache blocks / hot_blocks
    window: int
    requests: int
    measured_requests: int
    prompt_tokens_mean: float
    upper_bound_hit_ratio: float  # unlimited cache, every earlier request seen
    oracle: PolicyResult  # greedy cache-aware, ignoring load: the target's reference
    oracle_bounded: PolicyResult  # the same under the router's load bound: context
    policies: list[PolicyResult]
    tier_blocks_per_worker: int = 0
    tiered: PolicyResult | None = None  # the first policy again, with an offload tier


def summarize(
    workload: Workload,
    cfg: SimConfig,
    eps: float,
    policies: Sequence[PolicyResult],
    tiered: tuple[int, PolicyResult] | None = None,
) -> HitRateResult:
    """Run both oracles and the upper bound on the same sequence; rate `policies` (and a
    `(tier_blocks, result)` run with an offload tier) by them."""
    oracle = replace(run_policy(workload, cfg, OraclePlacer()), vs_oracle=1.0)
    bounded = run_policy(workload, cfg, OraclePlacer(eps))

    def rated(p: PolicyResult) -> PolicyResult:
        return replace(p, vs_oracle=p.hit_ratio / max(oracle.hit_ratio, 1e-12))

    measured = workload.requests[cfg.warmup :]
    return HitRateResult(
        workers=cfg.workers,
        capacity_blocks_per_worker=cfg.capacity_blocks,
        hot_blocks=workload.hot_blocks,
        cache_vs_hot=cfg.workers * cfg.capacity_blocks / max(1, workload.hot_blocks),
        window=cfg.window,
        requests=len(workload.requests),
        measured_requests=len(measured),
        prompt_tokens_mean=sum(len(r.tokens) for r in measured) / max(1, len(measured)),
        upper_bound_hit_ratio=upper_bound_hit_ratio(workload, cfg.warmup),
        oracle=oracle,
        oracle_bounded=rated(bounded),
        policies=[rated(p) for p in policies],
        tier_blocks_per_worker=tiered[0] if tiered else 0,
        tiered=rated(tiered[1]) if tiered else None,
    )


def hit_rate_rows(h: HitRateResult, wl: WorkloadConfig) -> list[str]:
    """The hit-rate table: one row per oracle and policy."""

    def overflow(p: PolicyResult) -> str:
        # Round-robin's order is by worker id, not by key: "not first" means nothing there.
        return (
            "-" if p.policy in ("round_robin", "oracle", "oracle_bounded") else f"{p.overflow:.3f}"
        )

    rows = [
        f"prefix hits: Zipf({wl.zipf_s}) over {wl.tenants} tenants x {wl.prompts_per_tenant} "
        f"system prompts, {h.workers} mixed workers with LRU caches of "
        f"{h.capacity_blocks_per_worker} blocks ({h.cache_vs_hot:.2f}x the {h.hot_blocks} "
        f"system-prompt blocks in all), {h.window} in flight, {h.measured_requests} of "
        f"{h.requests} requests measured (mean {h.prompt_tokens_mean:.0f} tokens); "
        f"upper bound (unlimited cache) {h.upper_bound_hit_ratio:.3f}",
        f"{'policy':<14} {'hit ratio':>9} {'/oracle':>8} {'/upper':>7} {'load max/avg peak':>17} "
        f"{'mean':>6} {'requests max/avg':>16} {'overflow':>8} {'wall s':>6}",
    ]
    tiered = [h.tiered] if h.tiered else []
    if h.tiered:
        rows[0] += f"; {h.tiered.policy}: with an offload tier of {h.tier_blocks_per_worker}"
    for p in [h.oracle, h.oracle_bounded, *h.policies, *tiered]:
        rows.append(
            f"{p.policy:<14} {p.hit_ratio:>9.3f} {p.vs_oracle:>7.3f}x "
            f"{p.hit_ratio / max(h.upper_bound_hit_ratio, 1e-12):>6.3f}x "
            f"{p.load_max_over_avg_peak:>17.2f} {p.load_max_over_avg_mean:>6.2f} "
            f"{p.requests_max_over_avg:>16.2f} {overflow(p):>8} {p.wall_s:>6.1f}"
        )
    return rows
