"""The peer benchmark's results: per round and point, the medians of rounds, the ratios
against llama-server, the targets, and where pdserve's 1-stream inter-token gap goes.

Lifecycle: `bench` turns each point's records into a `PointStats` (`point_stats`) and
appends it to `PeerResults.rounds`, plus one `GapSample` per round for the 1-stream
breakdown; after every round `derive` recomputes the summaries (medians over rounds of
each server's output tokens/s, TTFT p50 and ITL p50), the comparisons (the median of
the paired per-round ratios pdserve / llama-server: pairing cancels a drift of the
shared host's speed, which falls on both servers of a round alike), the targets and the
gap breakdown, and `write_outputs` rewrites `peer.json` (schema `pdserve.peer_bench/1`,
with the run's provenance) and `peer.md`. Nothing here measures: it only reduces.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness.metrics import RequestRecord, Slo, summarize
from loadtest.peer.config import TARGET_RATIO_1, TARGET_RATIO_16, PeerBenchConfig
from loadtest.reports.provenance import Provenance, describe
from loadtest.reports.result_file import write_result

SCHEMA = "pdserve.peer_bench/1"
PDSERVE = "pdserve"
LLAMA = "llama.cpp"
SERVERS = (PDSERVE, LLAMA)


@dataclass(frozen=True)
class PointStats:
    """One server at one point in one round."""

    server: str
    streams: int
    round: int
    ran_first: bool
    sent: int
    ok: int
    errors_by_code: dict[str, int]
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float
    prompt_tokens_mean: float
    tokens_per_chunk: float  # output tokens / chunks carrying text (1.0: one token a chunk)


def point_stats(
    server: str, streams: int, round_: int, ran_first: bool, records: Sequence[RequestRecord]
) -> PointStats:
    m = summarize(records, Slo())
    ok = [r for r in records if r.ok]
    chunks = sum(len(r.token_gaps_s) + 1 for r in ok if r.first_token_s is not None)
    return PointStats(
        server=server,
        streams=streams,
        round=round_,
        ran_first=ran_first,
        sent=m.sent,
        ok=m.ok,
        errors_by_code=m.errors_by_code,
        duration_s=m.duration_s,
        output_tokens=m.output_tokens,
        output_tok_s=m.output_token_throughput,
        ttft_p50_ms=m.ttft_ms.p50,
        itl_p50_ms=m.itl_ms.p50,
        tpot_p50_ms=m.tpot_ms.p50,
        e2e_p50_ms=m.e2e_ms.p50,
        prompt_tokens_mean=m.prompt_tokens / m.ok if m.ok else 0.0,
        tokens_per_chunk=m.output_tokens / chunks if chunks else 0.0,
    )


@dataclass(frozen=True)
class GapSample:
    """One round's view of the 1-stream inter-token gap, in ms (None: not measured).

    TPOT (a stream's mean gap, (end - first token) / (tokens - 1); p50 over the point's
    streams) is what the breakdown splits: it counts every token whichever chunk carried
    it, and it is a mean, like the step time it is held against. ITL p50 (the gaps
    between chunks) is context.
    """

    round: int
    pdserve_tpot_http: float
    pdserve_itl_http: float
    pdserve_tpot_grpc: float | None  # the same point over the gateway's gRPC API
    pdserve_decode_step: float | None  # the decode worker's own step (its load signal)
    llama_tpot: float
    llama_itl: float
    llama_ms_per_token: float | None  # llama-server's own timing of a generated token


@dataclass(frozen=True)
class ServerSummary:
    """Medians over rounds of one server at one point."""

    server: str
    streams: int
    rounds: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    tpot_p50_ms: float
    errors: int


@dataclass(frozen=True)
class Comparison:
    """pdserve / llama-server at one point: medians of the paired per-round ratios."""

    streams: int
    output_tok_s_ratio: float | None
    ttft_p50_ratio: float | None  # < 1: pdserve's first token comes sooner
    itl_p50_ratio: float | None
    pdserve_errors: int = 0  # failed or refused requests in the rounds compared
    llama_errors: int = 0


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None
    comparison: str
    threshold: float
    met: bool
    context: str


@dataclass(frozen=True)
class GapBreakdown:
    """Where pdserve's inter-token gap goes at 1 stream (medians over rounds, ms).

    serving_path = TPOT - decode step: everything between two tokens that is not the
    engine's step (the engine thread's hand-off, the worker's gRPC stream, the gateway's
    relay, the HTTP front door). It splits into http_front_door = TPOT over HTTP - TPOT
    over gRPC and grpc_path = TPOT over gRPC - decode step. llama-server's serving path
    is its TPOT less its own time per generated token.
    """

    tpot_http_ms: float
    itl_http_ms: float
    tpot_grpc_ms: float | None
    decode_step_ms: float | None
    serving_path_ms: float | None
    serving_path_share: float | None
    http_front_door_ms: float | None
    grpc_path_ms: float | None
    llama_tpot_ms: float
    llama_itl_ms: float
    llama_ms_per_token: float | None
    llama_serving_path_ms: float | None


@dataclass
class PeerResults:
    created: str
    config: PeerBenchConfig
    llama_server: list[str]  # the server's command line
    llama_cpp_python_version: str
    pdserve_cluster: str  # what the cluster was, in words
    rounds: list[PointStats] = field(default_factory=list)
    gaps: list[GapSample] = field(default_factory=list)
    summaries: list[ServerSummary] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    gap_breakdown: GapBreakdown | None = None
    schema: str = SCHEMA


def median(values: Iterable[float | None]) -> float | None:
    """The median of the finite values; None when there is none."""
    finite = [v for v in values if v is not None and v == v]
    return statistics.median(finite) if finite else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_server(points: Sequence[PointStats], server: str, streams: int) -> ServerSummary:
    mine = [p for p in points if p.server == server and p.streams == streams]
    return ServerSummary(
        server=server,
        streams=streams,
        rounds=len(mine),
        output_tok_s=median(p.output_tok_s for p in mine) or 0.0,
        ttft_p50_ms=median(p.ttft_p50_ms for p in mine) or float("nan"),
        itl_p50_ms=median(p.itl_p50_ms for p in mine) or float("nan"),
        tpot_p50_ms=median(p.tpot_p50_ms for p in mine) or float("nan"),
        errors=sum(p.sent - p.ok for p in mine),
    )


def compare(points: Sequence[PointStats], streams: int) -> Comparison:
    """The paired ratios of each round where both servers ran the point, then medians."""
    by_round: dict[int, dict[str, PointStats]] = {}
    for p in points:
        if p.streams == streams:
            by_round.setdefault(p.round, {})[p.server] = p
    pairs = [(r[PDSERVE], r[LLAMA]) for r in by_round.values() if PDSERVE in r and LLAMA in r]
    return Comparison(
        streams=streams,
        output_tok_s_ratio=median(ratio(a.output_tok_s, b.output_tok_s) for a, b in pairs),
        ttft_p50_ratio=median(ratio(a.ttft_p50_ms, b.ttft_p50_ms) for a, b in pairs),
        itl_p50_ratio=median(ratio(a.itl_p50_ms, b.itl_p50_ms) for a, b in pairs),
        pdserve_errors=sum(a.sent - a.ok for a, _ in pairs),
        llama_errors=sum(b.sent - b.ok for _, b in pairs),
    )


def _errors(c: Comparison) -> str:
    if not c.pdserve_errors + c.llama_errors:
        return ""
    return (f"; errors (refused or failed requests; a point with any cannot meet its "
            f"target): pdserve {c.pdserve_errors}, llama.cpp {c.llama_errors}")  # fmt: skip


def targets(comparisons: Sequence[Comparison]) -> list[Target]:
    """The issue's targets, for the points that ran: at 16 streams >= 1.5x llama-server's
    output tokens/s with a TTFT p50 no worse; at 1 stream >= 1.0x. A point where either
    server failed or refused a request meets nothing: a refusal is work not done, and
    the requests left out shorten the others' queues (a flattered TTFT)."""
    out = []
    for c in comparisons:
        clean = c.pdserve_errors + c.llama_errors == 0
        tok = c.output_tok_s_ratio
        if c.streams == 16:
            ttft_ok = c.ttft_p50_ratio is not None and c.ttft_p50_ratio <= 1.0
            ttft = "-" if c.ttft_p50_ratio is None else f"{c.ttft_p50_ratio:.2f}x"
            out.append(Target(
                name="16 streams: output tok/s / llama.cpp's, TTFT p50 no worse",
                measured=tok, comparison=">=", threshold=TARGET_RATIO_16,
                met=clean and ttft_ok and tok is not None and tok >= TARGET_RATIO_16,
                context=f"TTFT p50 ratio {ttft} (wanted <= 1.00x){_errors(c)}",
            ))  # fmt: skip
        elif c.streams == 1:
            out.append(Target(
                name="1 stream: output tok/s / llama.cpp's",
                measured=tok, comparison=">=", threshold=TARGET_RATIO_1,
                met=clean and tok is not None and tok >= TARGET_RATIO_1,
                context=f"one stream at a time, closed loop{_errors(c)}",
            ))  # fmt: skip
    return out


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def breakdown(gaps: Sequence[GapSample]) -> GapBreakdown | None:
    if not gaps:
        return None
    tpot = median(g.pdserve_tpot_http for g in gaps)
    grpc = median(g.pdserve_tpot_grpc for g in gaps)
    step = median(g.pdserve_decode_step for g in gaps)
    llama_tpot = median(g.llama_tpot for g in gaps)
    path = _minus(tpot, step)
    nan = float("nan")
    return GapBreakdown(
        tpot_http_ms=nan if tpot is None else tpot,
        itl_http_ms=median(g.pdserve_itl_http for g in gaps) or nan,
        tpot_grpc_ms=grpc,
        decode_step_ms=step,
        serving_path_ms=path,
        serving_path_share=path / tpot if path is not None and tpot else None,
        http_front_door_ms=_minus(tpot, grpc),
        grpc_path_ms=_minus(grpc, step),
        llama_tpot_ms=nan if llama_tpot is None else llama_tpot,
        llama_itl_ms=median(g.llama_itl for g in gaps) or nan,
        llama_ms_per_token=median(g.llama_ms_per_token for g in gaps),
        llama_serving_path_ms=_minus(llama_tpot, median(g.llama_ms_per_token for g in gaps)),
    )


def derive(results: PeerResults) -> None:
    streams = sorted({p.streams for p in results.rounds})
    results.summaries = [summarize_server(results.rounds, s, n) for n in streams for s in SERVERS]
    results.comparisons = [compare(results.rounds, n) for n in streams]
    results.targets = targets(results.comparisons)
    results.gap_breakdown = breakdown(results.gaps)


def _f(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]  # fmt: skip


def _gap_lines(g: GapBreakdown) -> list[str]:
    rows = [
        ["pdserve TPOT p50 over HTTP (what the client sees)", _f(g.tpot_http_ms, ".2f")],
        ["pdserve ITL p50 over HTTP (between chunks; context)", _f(g.itl_http_ms, ".2f")],
        ["pdserve TPOT p50 over gRPC", _f(g.tpot_grpc_ms, ".2f")],
        ["decode worker's step (its load signal)", _f(g.decode_step_ms, ".2f")],
        ["serving path = TPOT - step", _f(g.serving_path_ms, ".2f")],
        ["serving path's share of the gap", _f(g.serving_path_share, ".0%")],
        ["of it: the HTTP front door (TPOT HTTP - TPOT gRPC)", _f(g.http_front_door_ms, ".2f")],
        ["of it: engine loop, worker and gateway gRPC (TPOT gRPC - step)",
         _f(g.grpc_path_ms, ".2f")],
        ["llama-server TPOT p50", _f(g.llama_tpot_ms, ".2f")],
        ["llama-server ITL p50", _f(g.llama_itl_ms, ".2f")],
        ["llama-server's own time per generated token", _f(g.llama_ms_per_token, ".2f")],
        ["llama-server's serving path (TPOT - its own time)", _f(g.llama_serving_path_ms, ".2f")],
    ]  # fmt: skip
    return ["", "Where the 1-stream inter-token gap goes (medians over rounds, ms):", "",
            *_table(["part", "ms"], rows)]  # fmt: skip


def markdown(results: PeerResults, provenance: Provenance) -> str:
    cfg = results.config
    lines = [
        "# Peer benchmark: pdserve against llama.cpp's llama-server",
        "",
        describe(provenance) + ".",
        "",
        f"pdserve: {results.pdserve_cluster}. llama-server (llama-cpp-python "
        f"{results.llama_cpp_python_version}'s llama.cpp): `{' '.join(results.llama_server)}`.",
        f"Workload: chat-shaped prompts of ~{cfg.prompt_tokens} tokens, {cfg.output_tokens} "
        f"output tokens each (greedy, ignore_eos), `/v1/completions` streamed, one client; "
        f"{len({p.round for p in results.rounds})} paired rounds, who goes first alternating; "
        "medians of rounds; ratios are medians of the paired per-round ratios.",
        "",
    ]
    rows = []
    for s in results.summaries:
        rows.append([str(s.streams), s.server, _f(s.output_tok_s), _f(s.ttft_p50_ms, ".0f"),
                     _f(s.itl_p50_ms, ".1f"), _f(s.tpot_p50_ms, ".1f"), str(s.errors)])  # fmt: skip
    lines += _table(["streams", "server", "output tok/s", "TTFT p50 ms", "ITL p50 ms",
                     "TPOT p50 ms", "errors"], rows)  # fmt: skip
    lines += ["", *_table(
        ["streams", "tok/s ratio", "TTFT p50 ratio", "ITL p50 ratio"],
        [[str(c.streams), _f(c.output_tok_s_ratio, ".2f", "x"), _f(c.ttft_p50_ratio, ".2f", "x"),
          _f(c.itl_p50_ratio, ".2f", "x")] for c in results.comparisons],
    )]  # fmt: skip
    lines += ["", *_table(
        ["target", "measured", "wanted", "result", "context"],
        [[t.name, _f(t.measured, ".2f", "x"), f"{t.comparison} {t.threshold:g}x",
          "met" if t.met else "**not met**", t.context] for t in results.targets],
    )]  # fmt: skip
    if results.gap_breakdown is not None:
        lines += _gap_lines(results.gap_breakdown)
    return "\n".join(lines) + "\n"


def write_outputs(results: PeerResults, provenance: Provenance) -> Path:
    """Derive, then rewrite peer.json and peer.md; returns the markdown's path."""
    derive(results)
    out = results.config.out_dir
    write_result(out / "peer.json", results, provenance)
    path = out / "peer.md"
    path.write_text(markdown(results, provenance), encoding="utf-8")
    return path
