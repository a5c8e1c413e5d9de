"""The sections of docs/benchmarks.md: which renderer each result schema gets, in the
page's order, and what every section has around its renderer's tables.

Lifecycle: `loadtest.reports.results` reads each committed result file and calls
`section` on it, with the file's `StaleResult`s when it is not current (`freshness`).
`section` writes the heading; for a stale result a line "Stale since <commit>: <reason>"
per finding; the
provenance line (when, on which commit and host, with which command); the renderer's
tables (`engine_sections`, `cluster_sections`, `elastic_sections`); then the targets,
which read "not current" instead of met or not met when the result is stale. A renderer
reads only the file: nothing is measured or recomputed here, so the page says exactly
what the files say. A schema without a renderer gets its top-level numbers (`generic`),
so a new benchmark's results are quoted before anyone writes a table for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from loadtest.reports.cluster_sections import (
    decode_overload,
    fairness,
    gateway,
    headline,
    overload,
    router,
    sweep,
    tracing,
    transfer,
)
from loadtest.reports.elastic_sections import peer, shifting
from loadtest.reports.engine_sections import (
    accuracy,
    cache_fairness,
    engine,
    invariance,
    kv_memory,
    lora,
    preemption,
    roofline,
    row_attention,
    speculation,
    structured,
    tiled,
)
from loadtest.reports.markdown import Json, fmt, num, provenance_line, table, targets_table
from loadtest.reports.stale import StaleResult

Renderer = Callable[[Json], list[str]]


def generic(data: Json) -> list[str]:
    """Top-level numbers and flags of a schema without its own renderer."""
    rows = [
        [f"`{k}`", fmt(v, ".4g") if num(v) is not None else str(v)]
        for k, v in data.items()
        if isinstance(v, int | float | bool)
    ]
    return table(["field", "value"], rows)


#: schema -> (title, renderer), in the page's order.
SECTIONS: dict[str, tuple[str, Renderer]] = {
    "pdserve.headline/1": ("Headline: disaggregated vs colocated", headline),
    "pdserve.shifting/1": ("Shifting workload: elastic roles vs static and colocated", shifting),
    "pdserve.peer_bench/1": ("Peer: pdserve against llama.cpp's llama-server", peer),
    "pdserve.engine_bench/1": ("Engine: decode throughput", engine),
    "pdserve.engine_bench/2": ("Engine: decode throughput", engine),
    "roofline_bench/v1": ("Engine against this machine's roofs", roofline),
    "accuracy_gate/v1": ("Accuracy gate: reduced precision against float32", accuracy),
    "pdserve.transfer_bench/1": ("KV transfer", transfer),
    "pdserve.kv_bench/1": ("KV memory: 8-bit caches and the offload tier", kv_memory),
    "pdserve.spec_bench/1": ("Speculative decoding", speculation),
    "pdserve.cache_fairness_bench/1": (
        "Cache fairness: a hot prefix under a flood",
        cache_fairness,
    ),
    "pdserve.preemption_bench/1": ("Preemption: swap against recompute", preemption),
    "pdserve.router_bench/1": ("Router", router),
    "pdserve.gateway_bench/1": ("Gateway overhead", gateway),
    "pdserve.tracing_bench/1": ("Tracing cost", tracing),
    "pdserve.overload_bench/1": ("Overload: admission control at 3x capacity", overload),
    "pdserve.decode_overload_bench/1": (
        "Decode-heavy overload: ITL admission on against off",
        decode_overload,
    ),
    "pdserve.fairness_bench/1": ("Noisy neighbour: fairness between tenants", fairness),
    "pdserve.bench/1": ("Load sweep (pdserve-bench)", sweep),
    "structured_bench/v1": ("Structured output and logit processing: cost per step", structured),
    "pdserve.lora_bench/1": ("Multi-LoRA: a batch mixing adapters against the base model", lora),
    "pdserve.invariance_probe/1": ("Batch invariance of the linear kernels", invariance),
    "pdserve.tiled_bench/1": ("Batch invariance end to end", tiled),
    "pdserve.row_attention_bench/1": ("Batch invariance: attention by rows", row_attention),
    "pdserve.perf_gate/1": ("Performance gate", generic),
    "pdserve.soak/1": ("Soak: leaks, stranded KV and a decode worker's crash", generic),
}


def sort_key(schema: str, file: Path) -> tuple[int, str]:
    order = list(SECTIONS)
    return (order.index(schema) if schema in order else len(order), file.name)


def title(data: Json) -> str:
    """The heading of the result's section."""
    schema = str(data.get("schema", "unknown"))
    return SECTIONS.get(schema, (f"`{schema}`", generic))[0]


def section(data: Json, file: str, stale: Sequence[StaleResult] = ()) -> list[str]:
    """The heading, a line per finding in `stale`, the provenance line, the schema's
    tables and the targets (each "not current" when stale)."""
    schema = str(data.get("schema", "unknown"))
    heading, render = SECTIONS.get(schema, (f"`{schema}`", generic))
    marked = [f"**Not current.** {' '.join(s.line for s in stale)}", ""] if stale else []
    return [
        f"## {heading}",
        "",
        *marked,
        provenance_line(data, file),
        "",
        *render(data),
        *targets_table(data, current=not stale),
        "",
    ]
