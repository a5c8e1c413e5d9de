"""The load tester's workloads: which requests a run sends.

Lifecycle: `TrafficConfig` (flags `--workload ...`, env `PDSERVE_*`) is built once per
bench; `make_requests(cfg, synth, n, stream)` then draws a request list per run point.
System prompts depend only on `workload_seed`, so every point of a sweep (and every
deployment in a comparison) shares them; the per-request draws are seeded by `stream`
too, so two points never repeat each other's unique user text (which would turn into
prefix-cache hits that a real workload would not have).

Workloads:
- `chat`: multi-tenant chat. `tenants` x `prompts_per_tenant` system prompts whose
  popularity follows Zipf(`zipf_s`) (`workloads.prefix.ZipfSampler`), each followed by a
  unique user message; the shared system prompts are what the prefix cache and the
  router's prefix placement exploit.
- `long_mix`: the chat traffic with a `long_fraction` of long raw prompts (1-4k tokens,
  few output tokens) spread evenly through it: the prefill interference that
  disaggregation exists to remove.
- `synthetic`: raw prompts with prompt and output lengths drawn uniform or log-uniform.
- `trace`: replay of a JSONL trace (`loadtest/harness/trace.py` documents the schema).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.trace import parse_trace, trace_requests
from loadtest.workloads.prefix import ZipfSampler
from loadtest.workloads.prompt_text import TextSynth

WORKLOADS = ("chat", "long_mix", "synthetic", "trace")
DISTRIBUTIONS = ("uniform", "loguniform")


def parse_range(text: str) -> tuple[int, int]:
    """'lo-hi' (inclusive) or 'n' -> (lo, hi) with 1 <= lo <= hi."""
    lo_text, _, hi_text = text.partition("-")
    try:
        lo, hi = int(lo_text), int(hi_text or lo_text)
    except ValueError:
        raise ValueError(f"expected a token range like 16-64, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"a token range needs 1 <= lo <= hi, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class TrafficConfig:
    workload: str = field(default="chat", metadata={"help": f"one of {', '.join(WORKLOADS)}"})
    tenants: int = field(default=8, metadata={"help": "chat: tenants"})
    prompts_per_tenant: int = field(default=2, metadata={"help": "chat: system prompts each"})
    zipf_s: float = field(default=1.1, metadata={"help": "chat: Zipf exponent of popularity"})
    system_tokens: str = field(default="128-384", metadata={"help": "chat: system prompt"})
    user_tokens: str = field(default="16-64", metadata={"help": "chat: user message tokens"})
    chat_output_tokens: str = field(default="32-64", metadata={"help": "chat: output tokens"})
    long_fraction: float = field(
        default=0.1, metadata={"help": "long_mix: share of long-prompt requests"}
    )
    long_prompt_tokens: str = field(
        default="1024-4096", metadata={"help": "long_mix: long prompt tokens"}
    )
    long_output_tokens: str = field(
        default="4-16", metadata={"help": "long_mix: long request output tokens"}
    )
    synthetic_prompt_tokens: str = field(
        default="32-1024", metadata={"help": "synthetic: prompt tokens"}
    )
    synthetic_output_tokens: str = field(
        default="16-256", metadata={"help": "synthetic: output tokens"}
    )
    synthetic_dist: str = field(
        default="loguniform", metadata={"help": "synthetic: uniform or loguniform lengths"}
    )
    trace_path: Path | None = field(default=None, metadata={"help": "trace: JSONL file"})
    trace_time_scale: float = field(
        default=1.0, metadata={"help": "trace: multiply timestamp gaps (0.5 = twice as fast)"}
    )
    workload_seed: int = field(default=0, metadata={"help": "seed of every random draw"})

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.tenants < 1 or self.prompts_per_tenant < 1 or self.zipf_s <= 0:
            raise ValueError("tenants and prompts_per_tenant must be >= 1, zipf_s > 0")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        for name in (
            "system_tokens",
            "user_tokens",
            "chat_output_tokens",
            "long_prompt_tokens",
            "long_output_tokens",
            "synthetic_prompt_tokens",
            "synthetic_output_tokens",
        ):
            parse_range(getattr(self, name))
        if self.synthetic_dist not in DISTRIBUTIONS:
            raise ValueError(f"synthetic_dist must be one of {DISTRIBUTIONS}")
        if self.workload == "trace" and self.trace_path is None:
            raise ValueError("trace_path: the trace workload needs a JSONL file")
        if self.trace_time_scale <= 0:
            raise ValueError(f"trace_time_scale must be > 0, got {self.trace_time_scale}")


def draw_length(rng: random.Random, bounds: tuple[int, int], dist: str = "uniform") -> int:
    lo, hi = bounds
    if dist == "loguniform":
        return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
    return rng.randint(lo, hi)


def is_long(index: int, fraction: float) -> bool:
    """Whether request `index` of a long_mix is long: exactly `fraction` of every prefix
    of the sequence (rounded down), spread evenly rather than in random clumps."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


class _Chat:
    """The system prompts and their popularity; shared by every stream of one config."""

    def __init__(self, cfg: TrafficConfig, synth: TextSynth) -> None:
        rng = random.Random(f"{cfg.workload_seed}/system")
        bounds = parse_range(cfg.system_tokens)
        pairs = [
            (f"tenant-{t:02d}", p)
            for t in range(cfg.tenants)
            for p in range(cfg.prompts_per_tenant)
        ]
        rng.shuffle(pairs)  # rank r is pairs[r]: popular prompts spread over the tenants
        self.tenants = [tenant for tenant, _ in pairs]
        self.systems = [synth.text(rng, draw_length(rng, bounds)) for _ in pairs]
        self.zipf = ZipfSampler(len(pairs), cfg.zipf_s)

    def request(
        self, rng: random.Random, cfg: TrafficConfig, synth: TextSynth, rid: str
    ) -> BenchRequest:
        rank = self.zipf.sample(rng)
        user = synth.text(rng, draw_length(rng, parse_range(cfg.user_tokens)))
        return BenchRequest(
            request_id=rid,
            kind="chat",
            tenant=self.tenants[rank],
            max_tokens=draw_length(rng, parse_range(cfg.chat_output_tokens)),
            messages=(("system", self.systems[rank]), ("user", user)),
        )


def _long(rng: random.Random, cfg: TrafficConfig, synth: TextSynth, rid: str) -> BenchRequest:
    n = draw_length(rng, parse_range(cfg.long_prompt_tokens))
    out = draw_length(rng, parse_range(cfg.long_output_tokens))
    return BenchRequest(request_id=rid, kind="long", prompt=synth.text(rng, n), max_tokens=out)


def _synthetic(rng: random.Random, cfg: TrafficConfig, synth: TextSynth, rid: str) -> BenchRequest:
    n = draw_length(rng, parse_range(cfg.synthetic_prompt_tokens), cfg.synthetic_dist)
    out = draw_length(rng, parse_range(cfg.synthetic_output_tokens), cfg.synthetic_dist)
    return BenchRequest(request_id=rid, kind="synthetic", prompt=synth.text(rng, n), max_tokens=out)


def make_requests(
    cfg: TrafficConfig, synth: TextSynth, n: int, stream: int = 0
) -> list[BenchRequest]:
    """`n` requests of the configured workload (a trace gives at most its own length)."""
    rng = random.Random(f"{cfg.workload_seed}/{stream}")
    if cfg.workload == "trace":
        assert cfg.trace_path is not None
        with cfg.trace_path.open() as f:
            entries = parse_trace(f)
        return trace_requests(entries[:n], synth, rng, cfg.trace_time_scale)
    if cfg.workload == "synthetic":
        return [_synthetic(rng, cfg, synth, f"s{stream}-{i}") for i in range(n)]
    chat = _Chat(cfg, synth)
    out = []
    for i in range(n):
        rid = f"s{stream}-{i}"
        if cfg.workload == "long_mix" and is_long(i, cfg.long_fraction):
            out.append(_long(rng, cfg, synth, rid))
        else:
            out.append(chat.request(rng, cfg, synth, rid))
    return out
