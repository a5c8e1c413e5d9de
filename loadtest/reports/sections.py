"""Markdown sections of docs/benchmarks.md, one renderer per result schema.

Lifecycle: `loadtest.reports.results` reads each committed result file and calls `section` on
it; `section` writes the heading, the provenance line (when, on which commit and host,
with which command) and the renderer's tables. A renderer reads only the file: nothing
is measured or recomputed here, so the page says exactly what the files say. A schema
without a renderer gets its top-level numbers, so a new benchmark's results are quoted
before anyone writes a table for them.

The files are JSON written by `result_file.write_result`; they are read as plain dicts
(the one place loadtest does so), through `_num`/`_fmt` so that a missing or null
number prints as "-" rather than failing the whole page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Json = dict[str, Any]
Renderer = Callable[[Json], list[str]]
LATENCY_HEADER = ("pool", "route p50 ms", "p99", "PING p50 ms", "route/PING p50", "p99",
                  "round trips/route")  # fmt: skip
FAIRNESS_HEADER = ("phase", "tenant", "offered", "served", "attainment", "KV block-s",
                   "TTFT p50 ms")  # fmt: skip
HEADLINE_HEADER = ("rate req/s", "disagg. goodput", "attainment", "coloc. goodput",
                   "attainment", "goodput ratio")  # fmt: skip


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _dicts(value: object) -> list[Json]:
    """The objects of a JSON list (nothing, if it is not one)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _fmt(value: object, spec: str = ".2f", suffix: str = "") -> str:
    number = _num(value)
    return "-" if number is None else f"{number:{spec}}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _targets(data: Json) -> list[str]:
    targets = data.get("targets") or []
    if not targets:
        return []
    rows = [
        [t["name"], _fmt(t.get("measured"), ".3f"), f"{t['comparison']} {t['threshold']:g}",
         "met" if t.get("met") else "**not met**", t.get("context", "")]
        for t in targets
    ]  # fmt: skip
    return ["", *_table(["target", "measured", "wanted", "result", "context"], rows)]


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


def _side_tps(phase: Json, side: str) -> str:
    return _fmt((phase.get(side) or {}).get("tokens_per_s"), ".1f")


def _verdict(ratio: object, met: object) -> str:
    if _num(ratio) is None:
        return "-"
    return _fmt(ratio, ".2f", "x") + ("" if met is None else "" if met else " (**not met**)")


def engine(data: Json) -> list[str]:
    rows = [
        [str(p["batch_size"]), str(p["num_requests"]), _fmt(p["pdserve"]["tokens_per_s"], ".1f"),
         _fmt(p["transformers"]["tokens_per_s"], ".1f"), _fmt(p["ratio"], ".2f", "x"),
         "-" if p.get("target") is None else f">= {p['target']:.2f}x",
         "-" if p.get("met") is None else ("met" if p["met"] else "**not met**"),
         _side_tps(p, "transformers_cb"), _verdict(p.get("cb_ratio"), p.get("cb_met")),
         _side_tps(p, "pdserve_fp32"), _verdict(p.get("dtype_ratio"), p.get("dtype_met"))]
        for p in data.get("phases", [])
    ]  # fmt: skip
    header = ["batch", "requests", "pdserve tok/s", "transformers tok/s", "ratio", "target",
              "result", "HF CB tok/s", "vs HF CB", "pdserve fp32 tok/s", "vs fp32"]  # fmt: skip
    kv = data.get("kv", {})
    preset = data.get("config", {}).get("preset", "?")
    caveat = (
        [f"**Preset `{preset}`**: a few tiny requests per batch size, a check that the "
         "benchmark runs end to end, not a throughput figure to quote.", ""]
        if preset == "smoke" else []
    )  # fmt: skip
    dtype = data.get("machine", {}).get("dtype", "float32")
    return [
        "Decode tokens/s of pdserve against HF transformers on the same requests, run back "
        f"to back (preset `{preset}`, {dtype}; ratio = pdserve / transformers static "
        "`generate`; vs HF CB = pdserve / transformers' continuous batching, target >= 3x; "
        "vs fp32 = pdserve / pdserve in float32).",
        "",
        *caveat,
        *_table(header, rows),
        "",
        f"KV pool: {kv.get('total_blocks', '?')} blocks x {kv.get('block_size', '?')} tokens, "
        f"{_fmt(kv.get('pool_mib'), '.1f')} MiB; {kv.get('bytes_per_token', '?')} bytes/token.",
    ]


def transfer(data: Json) -> list[str]:
    rows = [
        [str(c["tokens"]), c["pattern"], _fmt(c["bytes"] / 2**20, ".1f"),
         _fmt(c["memcpy_gbps"]), _fmt(c["nixl_gbps"]), _fmt(c["tcp_gbps"]),
         _fmt(c["nixl_vs_memcpy"], ".2f", "x"), _fmt(c["nixl_vs_tcp"], ".2f", "x")]
        for c in data.get("cases", [])
    ]  # fmt: skip
    header = ["tokens", "pattern", "MiB", "memcpy GB/s", "NIXL GB/s", "TCP GB/s", "NIXL/memcpy",
              "NIXL/TCP"]  # fmt: skip
    one_block = [
        f"- one-block import (read + release) over {o['backend']}: median "
        f"{_fmt(o['median_ms'], '.3f')} ms, p99 {_fmt(o['p99_ms'], '.3f')} ms ({o['reps']} reps)"
        for o in data.get("one_block", [])
    ]
    return [
        "KV transfer between two processes over NIXL and the TCP fallback, against a "
        "single-thread memcpy of the same bytes measured in the same run (medians; every "
        f"import verified bitwise: {data.get('verified')}; every lease released: "
        f"{data.get('leases_clean')}).",
        "",
        *_table(header, rows),
        "",
        *one_block,
        *_targets(data),
    ]


def router(data: Json) -> list[str]:
    latency = [
        [r["pool"], _fmt(r["route"]["p50_ms"], ".3f"), _fmt(r["route"]["p99_ms"], ".3f"),
         _fmt(r["ping"]["p50_ms"], ".3f"), _fmt(r["route_vs_ping_p50"], ".2f", "x"),
         _fmt(r["route_vs_ping_p99"], ".2f", "x"), _fmt(r["round_trips_per_route"], ".3f")]
        for r in data.get("latency", [])
    ]  # fmt: skip
    hits = data.get("hit_rate", {})
    everyone = [hits.get("oracle"), hits.get("oracle_bounded"), *hits.get("policies", []),
                hits.get("tiered")]  # fmt: skip
    policies = [
        [p["policy"], _fmt(p["hit_ratio"], ".3f"), _fmt(p["vs_oracle"], ".3f", "x"),
         _fmt(p.get("load_max_over_avg_peak"), ".2f")]
        for p in everyone
        if p
    ]  # fmt: skip
    return [
        "Decision latency of one Router replica against Redis PING on the same connection "
        "(interleaved), and the prefix-hit ratio of each policy against a cache-aware oracle "
        f"(upper bound with an unlimited cache: {_fmt(hits.get('upper_bound_hit_ratio'), '.3f')}).",
        "",
        *_table(LATENCY_HEADER, latency),
        "",
        *_table(["policy", "hit ratio", "/oracle", "load max/avg peak"], policies),
        *_targets(data),
    ]


def gateway(data: Json) -> list[str]:
    return _table(
        ["gateway TTFT p50 ms", "direct Prefill p50 ms", "overhead ms", "paired median ms",
         "target ms", "pairs"],
        [[_fmt(data.get("gateway_ttft_p50_ms")), _fmt(data.get("direct_prefill_p50_ms")),
          _fmt(data.get("overhead_p50_ms")), _fmt(data.get("overhead_paired_p50_ms")),
          f"<= {_fmt(data.get('target_ms'), 'g')}", str(data.get("reps", "-"))]],
    )  # fmt: skip


def tracing(data: Json) -> list[str]:
    on, off = data.get("tracing_on", {}), data.get("tracing_off", {})
    return _table(
        ["tok/s on", "tok/s off", "throughput on/off", "TTFT p50 on/off", "cost", "target",
         "spans"],
        [[_fmt(on.get("output_tokens_per_s"), ".1f"), _fmt(off.get("output_tokens_per_s"), ".1f"),
          _fmt(data.get("throughput_ratio_on_off"), ".3f", "x"),
          _fmt(data.get("ttft_p50_ratio_on_off"), ".3f", "x"),
          _fmt(100 * (_num(data.get("throughput_cost")) or 0.0), ".1f", "%"),
          f"<= {_fmt(100 * (_num(data.get('target_cost')) or 0.0), '.0f', '%')}",
          str(data.get("spans_exported", "-"))]],
    )  # fmt: skip


def headline(data: Json) -> list[str]:
    rows = [
        [f"{c['rate']:g}", _fmt(c.get("disaggregated_goodput"), ".3f"),
         _fmt(c.get("disaggregated_attainment")), _fmt(c.get("colocated_goodput"), ".3f"),
         _fmt(c.get("colocated_attainment")), _fmt(c.get("goodput_ratio"), ".2f", "x")]
        for c in data.get("comparisons", [])
    ]  # fmt: skip
    capacities = [
        f"- {s['name']}: capacity {_fmt(s.get('capacity_rate'), '.3f')} req/s "
        f"({s.get('capacity_qualifier', '')})"
        for s in data.get("systems", [])
    ]
    return [
        "Disaggregated (1 prefill + 1 decode) against colocated (2 mixed) workers, one core "
        "each, on the long-prompt mix; capacity = the highest rate holding the attainment "
        "target.",
        "",
        *_table(HEADLINE_HEADER, rows),
        "",
        *capacities,
        f"- capacity ratio disaggregated / colocated: "
        f"{_fmt(data.get('capacity_ratio'), '.2f', 'x')}; short prompts only, goodput ratio "
        f"{_fmt(data.get('short_only_goodput_ratio'), '.2f', 'x')}",
    ]


def sweep(data: Json) -> list[str]:
    rows = [
        [p["label"], str(p["metrics"]["sent"]), str(p["metrics"]["ok"]),
         _fmt(p["metrics"]["goodput"], ".3f"), _fmt(p["metrics"]["slo_attainment"]),
         _fmt(p["metrics"]["ttft_ms"]["p50"], ".0f"), _fmt(p["metrics"]["itl_ms"]["p50"], ".0f")]
        for p in data.get("points", [])
    ]  # fmt: skip
    return _table(
        ["point", "sent", "ok", "goodput req/s", "attainment", "TTFT p50 ms", "ITL p50 ms"], rows
    )


def generic(data: Json) -> list[str]:
    """Top-level numbers and flags of a schema without its own renderer."""
    rows = [
        [f"`{k}`", _fmt(v, ".4g") if _num(v) is not None else str(v)]
        for k, v in data.items()
        if isinstance(v, int | float | bool)
    ]
    return _table(["field", "value"], rows)


def _counts(counts: object) -> str:
    if not isinstance(counts, dict) or not counts:
        return "-"
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def _ms3(dist: object, keys: tuple[str, str, str] = ("p50_ms", "p90_ms", "max_ms")) -> str:
    d = dist if isinstance(dist, dict) else {}
    return " / ".join(_fmt(d.get(k), ".0f") for k in keys)


def overload(data: Json) -> list[str]:
    cap = data.get("capacity", {})
    run = data.get("overload", {})
    cfg = data.get("config", {})
    rows = [
        [c["priority"], _fmt(c.get("budget_s"), "g"), str(c.get("offered", "-")),
         str(c.get("served", "-")), _fmt(c.get("attainment")), _counts(c.get("refused_by_status")),
         _counts(c.get("refused_by_reason")),
         _ms3(c.get("refusal_latency"), ("p50_ms", "p99_ms", "max_ms")),
         str(c.get("late_refusals", "-")), _ms3(c.get("ttft")),
         str(c.get("served_past_budget", "-"))]
        for c in run.get("classes", [])
    ]  # fmt: skip
    header = ["class", "budget s", "offered", "served", "attainment", "refused by status",
              "by reason", "refusal ms p50 / p99 / max", "late refusals",
              "TTFT ms p50 / p90 / max", "served past budget + 10%"]  # fmt: skip
    leaks = data.get("leaks", {})
    return [
        f"Capacity {_fmt(cap.get('capacity_rate'), '.3f')} req/s ({cap.get('qualifier', '?')}; "
        f"the highest Poisson rate of the class mix `{cfg.get('class_mix', '?')}` "
        f"(critical, standard, sheddable) holding {_fmt(cfg.get('attainment_target'), 'g')} "
        f"attainment), then {_fmt(cfg.get('overload_factor'), 'g')}x that "
        f"({_fmt(data.get('overload_rate'), '.3f')} req/s) for "
        f"{_fmt(run.get('duration_s'), 'g')} s. A request meets its SLO when it completes "
        "with its first token within its class's TTFT budget.",
        "",
        *_table(header, rows),
        "",
        f"- goodput under overload {_fmt(run.get('goodput', {}).get('requests_per_s'), '.3f')} "
        f"req/s against {_fmt(data.get('goodput_at_capacity_rps'), '.3f')} req/s at capacity: "
        f"**{_fmt(data.get('goodput_ratio'), '.2f', 'x')}**",
        f"- leak check after the run: {'clean' if leaks.get('clean') else '**not clean**'}",
        *_targets(data),
    ]


def fairness(data: Json) -> list[str]:
    rows = [
        [p["label"], t["tenant"], str(t.get("offered", "-")), str(t.get("served", "-")),
         _fmt(t.get("attainment")), _fmt(t.get("kv_block_seconds"), ".0f"),
         _fmt(t.get("ttft", {}).get("p50_ms"), ".0f")]
        for p in data.get("phases", [])
        for t in p.get("tenants", [])
    ]  # fmt: skip
    iso = [
        [i["tenant"], f"{i['noisy_phase']} / {i.get('alone_phase', 'alone')}",
         _fmt(i.get("alone_attainment")),
         _fmt(i.get("noisy_attainment")), _fmt(i.get("ratio"), ".2f", "x")]
        for i in data.get("isolation", [])
    ]  # fmt: skip
    jain = [[label, _fmt(value, ".3f")] for label, value in data.get("kv_jain", {}).items()]
    cfg = data.get("config", {})
    return [
        f"Tenants A, B, C (standard, weight 1), each share "
        f"{_fmt(data.get('share_rate'), '.3f')} req/s; A sends "
        f"{_fmt(cfg.get('noisy_factor'), 'g')} shares in the noisy phases; all send "
        f"{_fmt(cfg.get('backlog_factor'), 'g')} in the backlogged ones. `_2gw`: A through "
        "gateway 0, B and C through gateway 1 (shared Redis and workers).",
        "",
        *_table(FAIRNESS_HEADER, rows),
        "",
        *_table(["tenant", "phases", "alone attainment", "noisy attainment", "ratio"], iso),
        "",
        *_table(["backlogged phase", "Jain's index of KV-block-seconds"], jain),
        *_targets(data),
    ]


def structured(data: Json) -> list[str]:
    """Per-step cost of structured output and logit processing at one batch size."""
    rows = [
        [
            str(b.get("name")),
            _fmt(_num(b.get("median_ms")), ".1f"),
            _fmt(_num(b.get("ratio")), ".2f", "x"),
            str(len(b.get("step_ms") or [])),
        ]
        for b in _dicts(data.get("batches"))
    ]
    mask = _fmt(_num(data.get("mask_ms_per_step")), ".2f")
    return [
        f"Batch of {data.get('batch')} decoding requests; {data.get('note', '')}.",
        "",
        *_table(["batch", "median step ms", "ratio to plain", "steps timed"], rows),
        "",
        f"Grammar masks of the constrained rows, timed alone: {mask} ms per step.",
    ]


def roofline(data: Json) -> list[str]:
    """The engine's prefill and decode GFLOPS as fractions of roofs measured in the run."""
    rows = []
    for r in data.get("precisions", []):
        for p in r.get("prefill", []):
            rows.append([r["name"], f"prefill {p['tokens']} tokens", _fmt(p["tokens_per_s"], ".0f")
                         + " tok/s", _fmt(p["gflops"], ".1f"), _fmt(p["roof_gflops"], ".0f"),
                         _fmt(p["fraction"], ".2f")])  # fmt: skip
        for d in r.get("decode", []):
            rows.append([r["name"], f"decode batch {d['batch']}", _fmt(d["step_ms"], ".1f")
                         + " ms/step", _fmt(d["gflops"], ".1f"), _fmt(d["roof_gflops"], ".0f"),
                         _fmt(d["fraction"], ".2f")])  # fmt: skip
        rows.append([r["name"], "batch-1 bandwidth bound", _fmt(r.get("bandwidth_bound_ms"), ".1f")
                     + " ms", "-", "-", _fmt(r.get("bandwidth_fraction"), ".2f")])  # fmt: skip
    header = ["precision", "work", "speed", "GFLOPS", "roof GFLOPS", "fraction"]
    return [
        f"{data.get('threads', '?')} torch thread(s); copy bandwidth "
        f"{_fmt(data.get('bandwidth_gb_s'), '.1f')} GB/s. {data.get('note', '')}.",
        "",
        *_table(header, rows),
        *_targets(data),
    ]


def _accuracy_rows(modes: list[Json]) -> list[list[str]]:
    return [
        [m["name"], _fmt(m["perplexity"], ".3f"), _fmt(100 * m["ppl_rise"], "+.2f", "%"),
         f"<= +{100 * m['max_ppl_rise']:.0f}%", _fmt(m["forced_agreement"], ".3f"),
         f">= {m['min_agreement']:.2f}", _fmt(m["agreement"], ".3f"),
         _fmt(m["prefix_agreement"], ".3f"), "pass" if m["passed"] else "**fail**"]
        for m in modes
    ]  # fmt: skip


def accuracy(data: Json) -> list[str]:
    """Perplexity and agreement of each reduced-precision mode against float32, and
    transformers' own bf16 against its float32 where the run measured it."""
    header = ["mode", "perplexity", "rise", "bound", "forced agreement", "floor",
              "free agreement", "free prefix", "gate"]  # fmt: skip
    lines = [
        f"{data.get('reference_tokens', '?')} reference tokens, {data.get('prompts', '?')} "
        f"parity prompts, {data.get('continuation_tokens', '?')} tokens each. "
        f"{data.get('note', '')}.",
        "",
        *_table(header, _accuracy_rows(data.get("modes", []))),
    ]
    if data.get("reference"):
        lines += [
            "",
            "The yardstick, same run and inputs: transformers' own bfloat16 against its own "
            "float32, scored the same way (its gate column says whether it would pass). "
            f"transformers' float32 continuations equal the float32 engine's on "
            f"{data.get('reference_fp32_same', '?')} of {data.get('prompts', '?')} prompts.",
            "",
            *_table(header, _accuracy_rows(data["reference"])),
        ]
    return lines


def kv_memory(data: Json) -> list[str]:
    capacity = [
        [c["cache"], c["stored_dtype"], str(c["bytes_per_block"]), str(c["blocks"]),
         _fmt(c["vs_bfloat16"], ".2f", "x"), _fmt(c["vs_float32"], ".2f", "x")]
        for c in data.get("capacity", [])
    ]  # fmt: skip
    throughput = [
        [t["cache"], _fmt(t["tokens_per_s"], ".1f"), _fmt(t["vs_unquantized"], ".2f", "x"),
         ", ".join(_fmt(x, ".1f") for x in t["rounds_tokens_per_s"]),
         ", ".join(_fmt(x, ".2f", "x") for x in t.get("round_ratios", [])) or "-",
         _fmt(t.get("median_round_ratio"), ".2f", "x")]
        for t in data.get("throughput", [])
    ]  # fmt: skip
    o = data.get("offload") or {}
    offload = (
        [f"Offload: a {o['prompt_tokens']}-token prompt evicted from a {o['pool_blocks']}-block "
         f"pool; TTFT recomputed {o['recompute_ttft_s']} s, restored from a "
         f"{o['tier_blocks']}-block tier {o['tier_ttft_s']} s ({o['restored_blocks']} blocks "
         f"restored): {_fmt(o['ttft_ratio'], '.3f')}x."]
        if o else []
    )  # fmt: skip
    return [
        f"KV cache dtypes and the offload tier; compute {data.get('compute_dtype')}, "
        f"{data.get('threads')} thread(s). Capacity of "
        f"{_fmt(data.get('capacity_bytes', 0) / 2**20, '.0f')} MiB:",
        "",
        *_table(["cache", "stored", "bytes/block", "blocks", "/bf16", "/fp32"], capacity),
        "",
        "Output tokens/s at batch 32 (best of rounds, each run in its own process, order rotated):",
        "",
        *_table(
            ["cache", "tok/s", "/unquantized", "rounds", "round by round", "median"], throughput
        ),
        "",
        *offload,
        *_targets(data),
    ]


def speculation(data: Json) -> list[str]:
    rows = [
        [w["workload"], str(w["requests"]), _fmt(w["off_tokens_per_s"], ".1f"),
         _fmt(w["spec_tokens_per_s"], ".1f"), _fmt(w["ratio"], ".2f", "x"),
         _fmt(w["acceptance_rate"], ".2f"), _fmt(w["tokens_per_verification"], ".2f")]
        for w in data.get("workloads", [])
    ]  # fmt: skip
    head = ["workload", "requests", "off tok/s", "auto tok/s", "auto/off", "acceptance",
            "tokens/verification"]  # fmt: skip
    return [
        f"Decode tokens/s at batch 1, greedy, {data.get('max_tokens')} tokens per request, "
        f"compute {data.get('compute_dtype')}, {data.get('threads')} thread(s); best of "
        f"{data.get('reps')} interleaved rounds per side. Speculation `auto`: prompt-lookup "
        "drafts with adaptive length.",
        "",
        *_table(head, rows),
        *_targets(data),
    ]


def lora(data: Json) -> list[str]:
    """One batch on the base model against the same batch mixing four LoRA adapters."""
    rows = [
        [
            str(s.get("name")),
            _fmt(_num(s.get("tokens_per_s")), ".1f"),
            _fmt(_num(s.get("ratio")), ".2f", "x"),
            _fmt(_num(s.get("step_ms")), ".1f"),
        ]
        for s in _dicts(data.get("sides"))
    ]
    return [
        f"Batch of {data.get('batch')} greedy requests, {data.get('max_tokens')} tokens each, "
        f"{data.get('compute_dtype')}; a mixed batch spreads its requests over "
        f"{data.get('adapters_per_batch')} adapters of one shape (every step mixes them all). "
        "Shapes: `qv-r8` is PEFT's default for Llama (q and v, rank 8), `all-linear-r16` every "
        "projection at rank 16. Tokens/s over prefill and decode, best round of each.",
        "",
        *_table(["batch", "tokens/s", "ratio to base", "decode step ms"], rows),
        *_targets(data),
    ]


#: schema -> (title, renderer), in the page's order.
SECTIONS: dict[str, tuple[str, Renderer]] = {
    "pdserve.headline/1": ("Headline: disaggregated vs colocated", headline),
    "pdserve.engine_bench/1": ("Engine: decode throughput", engine),
    "pdserve.engine_bench/2": ("Engine: decode throughput", engine),
    "roofline_bench/v1": ("Engine against this machine's roofs", roofline),
    "accuracy_gate/v1": ("Accuracy gate: reduced precision against float32", accuracy),
    "pdserve.transfer_bench/1": ("KV transfer", transfer),
    "pdserve.kv_bench/1": ("KV memory: 8-bit caches and the offload tier", kv_memory),
    "pdserve.spec_bench/1": ("Speculative decoding", speculation),
    "pdserve.router_bench/1": ("Router", router),
    "pdserve.gateway_bench/1": ("Gateway overhead", gateway),
    "pdserve.tracing_bench/1": ("Tracing cost", tracing),
    "pdserve.overload_bench/1": ("Overload: admission control at 3x capacity", overload),
    "pdserve.fairness_bench/1": ("Noisy neighbour: fairness between tenants", fairness),
    "pdserve.bench/1": ("Load sweep (pdserve-bench)", sweep),
    "structured_bench/v1": ("Structured output and logit processing: cost per step", structured),
    "pdserve.lora_bench/1": ("Multi-LoRA: a batch mixing adapters against the base model", lora),
}


def sort_key(schema: str, file: Path) -> tuple[int, str]:
    order = list(SECTIONS)
    return (order.index(schema) if schema in order else len(order), file.name)


def section(data: Json, file: str) -> list[str]:
    schema = str(data.get("schema", "unknown"))
    title, render = SECTIONS.get(schema, (f"`{schema}`", generic))
    return [f"## {title}", "", provenance_line(data, file), "", *render(data), ""]
