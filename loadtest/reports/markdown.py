"""The parts every section of docs/benchmarks.md is built from: numbers read safely out
of a result file, markdown tables, the targets table and the provenance line.

Lifecycle: the renderers (`engine_sections`, `cluster_sections`) and `sections.section`
call these while the page is rendered. Result files are JSON written by
`result_file.write_result`; they are read as plain dicts (the one place loadtest does
so), through `num`/`fmt` so that a missing or null number prints as "-" rather than
failing the whole page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Json = dict[str, Any]
NOT_CURRENT = "not current"  # a stale result's targets, in place of met / not met


def num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def dicts(value: object) -> list[Json]:
    """The objects of a JSON list (nothing, if it is not one)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def mapping(value: object) -> Json:
    """A JSON object (an empty one, if it is not one)."""
    return value if isinstance(value, dict) else {}


def fmt(value: object, spec: str = ".2f", suffix: str = "") -> str:
    number = num(value)
    return "-" if number is None else f"{number:{spec}}{suffix}"


#: The engine benchmark keeps its verdicts in its phases, one row per batch size:
#: (ratio key, threshold key or None where the file states no threshold, verdict key,
#: the target's name after "batch N: ").
_ENGINE_VERDICTS = (
    ("ratio", "target", "met", "pdserve / transformers tok/s"),
    ("cb_ratio", None, "cb_met", "pdserve / transformers CB tok/s"),
    ("dtype_ratio", "dtype_target", "dtype_met", "pdserve / pdserve float32 tok/s"),
)


def targets_of(data: Json) -> list[Json]:
    """Every target a result states, as `targets` entries: its `targets` list and, for
    the engine benchmark, the verdicts its phases carry (the page counts and lists
    open targets from this, so no verdict of a file goes uncounted)."""
    found = dicts(data.get("targets"))
    if not str(data.get("schema", "")).startswith("pdserve.engine_bench/"):
        return found
    for phase in dicts(data.get("phases")):
        for ratio, threshold, met, label in _ENGINE_VERDICTS:
            if phase.get(met) is None:
                continue
            found.append({
                "name": f"batch {phase.get('batch_size')}: {label}",
                "measured": phase.get(ratio),
                "threshold": phase.get(threshold) if threshold else None,
                "comparison": ">=",
                "met": bool(phase[met]),
            })  # fmt: skip
    return found


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def verdict(met: object, current: bool = True) -> str:
    """A target's result column: met or not met, or "not current" for a stale result
    (whatever it was when measured, it says nothing about main now)."""
    if not current:
        return NOT_CURRENT
    return "met" if met else "**not met**"


def targets_table(data: Json, current: bool = True) -> list[str]:
    """The result's `targets` as a table (nothing if it has none), led by a blank line."""
    targets = data.get("targets") or []
    if not targets:
        return []
    rows = [
        [t["name"], fmt(t.get("measured"), ".3f"), f"{t['comparison']} {t['threshold']:g}",
         verdict(t.get("met"), current), t.get("context", "")]
        for t in targets
    ]  # fmt: skip
    return ["", *table(["target", "measured", "wanted", "result", "context"], rows)]


def provenance_line(data: Json, file: str) -> str:
    p = data["provenance"]
    host = p.get("host", {})
    commit = p.get("commit")
    where = f"commit `{commit[:12]}`" if commit else "no git checkout"
    if p.get("dirty"):
        where += " with uncommitted changes"
    return (
        f"Taken {p.get('taken_at', '?')} on {where}, host {host.get('hostname', '?')} "
        f"({host.get('cpu_model', '?')}; {host.get('usable_cpus', '?')} of "
        f"{host.get('cpu_count', '?')} CPUs usable). File [{file}]({file}); command "
        f"`{p.get('command', '?')}`."
    )
