"""The shifting-workload benchmark's report: `shifting.json` and `shifting.md`.

Lifecycle: `shifting.run_shifting` calls `write_outputs` after every run of a
deployment (so an interrupted run keeps what it measured); it derives the medians and
ratios (`shifting_results.derive`), writes `shifting.json` (schema `pdserve.shifting/1`:
the config, the schedule, the SLO, the run's provenance, and per deployment every run's
metrics, per phase and whole, with one record per request) and renders `shifting.md`:
the schedule and the SLO as measured, the judged ratio against its target, the first
deployment's goodput ratios over each other one per phase (the one over `static` on the
long-prompt phases is the cost of the flexibility), then each phase's attainment,
goodput, TTFT and ITL per deployment, and every run.
"""

from __future__ import annotations

from pathlib import Path

from loadtest.harness.bench_report import detail_lines, slo_text
from loadtest.headline.deployment import layout
from loadtest.headline.shifting_results import (
    BEST,
    PairRatio,
    PhaseSummary,
    ShiftingResults,
    derive,
)
from loadtest.reports.provenance import Provenance
from loadtest.reports.result_file import write_result


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pair(value: float | None, other: float | None) -> str:
    """'p50 / p90' in ms."""
    return f"{_fmt(value, '.0f')} / {_fmt(other, '.0f')}"


def _phase_names(results: ShiftingResults) -> list[str]:
    return [f"{k + 1} {p.name}" for k, p in enumerate(results.phases)]


def _header(results: ShiftingResults) -> list[str]:
    cfg = results.config
    title = " vs ".join(f"{n} ({layout(n).description})" for n in cfg.system_list)
    dtype = cfg.dtype.value if cfg.dtype else "auto (the workers' default)"
    t = results.traffic
    lines = [
        f"# Shifting workload: {title}",
        "",
        f"{results.created}; {results.host_cpus} CPU cores; one core and one torch thread per "
        f"worker (pinned: {cfg.pin_workers}); compute dtype {dtype}; router placement on "
        f"embedded Redis; KV over {cfg.kv_backend}; the 1P+1D gateways prefill prompts of "
        f"up to {cfg.local_prefill_max_tokens} tokens on the decode worker. Chat: "
        f"{t.tenants} tenants x {t.prompts_per_tenant} system prompts of {t.system_tokens} "
        f"tokens, user {t.user_tokens}, output {t.chat_output_tokens}; long prompts "
        f"{t.long_prompt_tokens} tokens, output {t.long_output_tokens}.",
        "",
        f"Phases, one Poisson request sequence per round that every deployment runs in "
        f"turn (the order reverses every round), {cfg.rounds} round(s) per rate scale "
        f"({', '.join(f'{x:g}' for x in cfg.scale_list)}):",
        "",
        "| phase | from s | to s | long prompts | rate req/s at scale 1 |",
        "|---|---|---|---|---|",
    ]
    for name, p in zip(_phase_names(results), results.phases, strict=True):
        lines.append(
            f"| {name} | {p.start_s:g} | {p.end_s:g} | {p.long_fraction:.0%} | {p.rate:g} |"
        )
    return [*lines, "", *_slo_lines(results)]


def _slo_lines(results: ShiftingResults) -> list[str]:
    cfg = results.config
    if results.slo is None:
        return ["SLO: not set yet (the warm-up has not run)."]
    steps = ", ".join(f"{s.name} {_fmt(s.unloaded_step_ms, '.0f')} ms" for s in results.systems)
    how = (
        f"the ITL SLO is {cfg.itl_slo_step_factor:g}x the unloaded decode step measured "
        "in this run (the median gap between streamed tokens of the warm-up requests, "
        "sent one at a time)"
        if cfg.derives_itl_slo
        else "the ITL SLO is given"
    )
    return [
        f"SLO: {slo_text(results.slo)}; {how}. Unloaded decode step per deployment: {steps}. "
        "Attainment counts errors as misses; goodput = requests within the SLO per second."
    ]


def _ratio_line(p: PairRatio, first: str, phases: list[str]) -> str:
    other = "the better other" if p.other == BEST else p.other
    per_phase = ", ".join(
        f"{n} {_fmt(r, '.2f', 'x')}" for n, r in zip(phases, p.phases, strict=False)
    )
    rounds = ", ".join(_fmt(r, ".2f", "x") for r in p.rounds)
    return (
        f"- goodput {first} / {other} at scale {p.scale:g}: whole {_fmt(p.whole, '.2f', 'x')} "
        f"(rounds: {rounds or '-'}); per phase: {per_phase or '-'}"
    )


def _result_lines(results: ShiftingResults) -> list[str]:
    cfg = results.config
    if len(results.systems) < 2:
        return []
    first = results.systems[0].name
    if results.ratio is None:
        judged = f"- ratio undefined so far ({results.ratio_basis or 'no paired round yet'})"
    else:
        verdict = "met" if results.target_met else "NOT met"
        judged = (
            f"- **{results.ratio:.2f}x**: {results.ratio_basis} "
            f"(target >= {cfg.target_ratio:g}x: {verdict})"
        )
    lines = ["## Result", "", judged]
    if len(cfg.scale_list) > 1:
        lines += [
            f"- capacity of {s.name}: rate scale {_fmt(s.capacity_scale, '.3f')} "
            f"({s.capacity_qualifier}; median whole-schedule attainment >= "
            f"{cfg.attainment_target:.0%})"
            for s in results.systems
        ]
    phases = _phase_names(results)
    lines += [_ratio_line(p, first, phases) for p in results.ratios]
    lines += _cost_lines(results)
    return [*lines, "", "A ratio reads - where it is undefined: the other had no goodput there."]


def _cost_lines(results: ShiftingResults) -> list[str]:
    """The first deployment against the static split on the long-prompt phases."""
    first = results.systems[0].name
    long_phases = [k for k, p in enumerate(results.phases) if p.long_fraction > 0]
    lines = []
    for p in results.ratios:
        if p.other != "static" or first == "static" or not long_phases:
            continue
        cost = ", ".join(
            f"phase {k + 1} {_fmt(p.phases[k] if k < len(p.phases) else None, '.2f', 'x')}"
            for k in long_phases
        )
        lines.append(
            f"- cost of the flexibility on the long-prompt phases at scale {p.scale:g}: "
            f"goodput {first} / static {cost} (1.00x: none)"
        )
    return lines


def _phase_row(name: str, system: str, rounds: int, ph: PhaseSummary) -> str:
    return (
        f"| {name} | {system} | {rounds} | {ph.sent} | {_fmt(ph.attainment, '.2f')} | "
        f"{_fmt(ph.goodput)} | {_pair(ph.ttft_p50_ms, ph.ttft_p90_ms)} | "
        f"{_pair(ph.itl_p50_ms, ph.itl_p90_ms)} |"
    )


def _phase_tables(results: ShiftingResults) -> list[str]:
    """Per scale: each phase (then the whole schedule), each deployment in run order."""
    lines: list[str] = []
    names = [*_phase_names(results), "whole"]
    for x in results.config.scale_list:
        at_x = [(s.name, q) for s in results.systems for q in s.scales if q.scale == x]
        if not at_x:
            continue
        lines += [
            "", f"## Per phase at rate scale {x:g} (medians over rounds)", "",
            "| phase | deployment | rounds | sent | attainment | goodput req/s "
            "| TTFT ms p50 / p90 | ITL ms p50 / p90 |",
            "|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for k, name in enumerate(names):
            for system, q in at_x:
                ph = q.phases[k] if k < len(q.phases) else q.whole
                lines.append(_phase_row(name, system, q.rounds, ph))
    return lines


def _run_lines(results: ShiftingResults) -> list[str]:
    lines = [
        "",
        "## Runs",
        "",
        "| scale | round | turn | deployment | started | attainment per phase | whole "
        "| goodput req/s | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    details: list[str] = []
    runs = sorted(
        ((r, s.name) for s in results.systems for r in s.runs),
        key=lambda x: (x[0].scale, x[0].round, x[0].position),
    )
    for r, name in runs:
        per_phase = " / ".join(_fmt(m.slo_attainment if m.sent else None, ".2f") for m in r.phases)
        lines.append(
            f"| {r.scale:g} | {r.round + 1} | {r.position + 1} | {name} | {r.started_at} | "
            f"{per_phase} | {r.whole.slo_attainment:.2f} | {r.whole.goodput:.3f} | "
            f"{r.whole.errors} |"
        )
        label = f"{name}, scale {r.scale:g}, round {r.round + 1}"
        details += detail_lines(label, r.whole)
    return [*lines, "", *details]


def markdown(results: ShiftingResults) -> str:
    walls = ", ".join(f"{s.name} {s.wall_s / 60:.1f} min" for s in results.systems)
    lines = [*_header(results), "", *_result_lines(results), *_phase_tables(results)]
    lines += [*_run_lines(results), "", f"Time under load: {walls}."]
    return "\n".join(lines) + "\n"


def write_outputs(results: ShiftingResults, provenance: Provenance) -> Path:
    """Derive, then write shifting.json and shifting.md; returns the markdown's path."""
    out = results.config.out_dir
    derive(results)
    write_result(out / "shifting.json", results, provenance)
    md = out / "shifting.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(results))
    return md
