"""Sections of docs/benchmarks.md for the benchmarks between processes: KV transfer, the
router, the gateway's and tracing's overhead, the headline, the load sweep, overload and
fairness.

Lifecycle: `sections.SECTIONS` maps each schema to one renderer here; `sections.section`
calls it with the result file's JSON and adds the heading, provenance and targets around
its lines. A renderer only reads the file.
"""

from __future__ import annotations

from loadtest.reports.markdown import Json, fmt, num, table

LATENCY_HEADER = ("pool", "route p50 ms", "p99", "PING p50 ms", "route/PING p50", "p99",
                  "round trips/route")  # fmt: skip
FAIRNESS_HEADER = ("phase", "tenant", "offered", "served", "attainment", "KV block-s",
                   "TTFT p50 ms")  # fmt: skip
HEADLINE_HEADER = ("rate req/s", "disagg. goodput", "attainment", "coloc. goodput",
                   "attainment", "goodput ratio")  # fmt: skip


def transfer(data: Json) -> list[str]:
    rows = [
        [str(c["tokens"]), c["pattern"], fmt(c["bytes"] / 2**20, ".1f"),
         fmt(c["memcpy_gbps"]), fmt(c["nixl_gbps"]), fmt(c["tcp_gbps"]),
         fmt(c["nixl_vs_memcpy"], ".2f", "x"), fmt(c["nixl_vs_tcp"], ".2f", "x")]
        for c in data.get("cases", [])
    ]  # fmt: skip
    header = ["tokens", "pattern", "MiB", "memcpy GB/s", "NIXL GB/s", "TCP GB/s", "NIXL/memcpy",
              "NIXL/TCP"]  # fmt: skip
    one_block = [
        f"- one-block import (read + release) over {o['backend']}: median "
        f"{fmt(o['median_ms'], '.3f')} ms, p99 {fmt(o['p99_ms'], '.3f')} ms ({o['reps']} reps)"
        for o in data.get("one_block", [])
    ]
    return [
        "KV transfer between two processes over NIXL and the TCP fallback, against a "
        "single-thread memcpy of the same bytes measured in the same run (medians; every "
        f"import verified bitwise: {data.get('verified')}; every lease released: "
        f"{data.get('leases_clean')}).",
        "",
        *table(header, rows),
        "",
        *one_block,
    ]


def router(data: Json) -> list[str]:
    latency = [
        [r["pool"], fmt(r["route"]["p50_ms"], ".3f"), fmt(r["route"]["p99_ms"], ".3f"),
         fmt(r["ping"]["p50_ms"], ".3f"), fmt(r["route_vs_ping_p50"], ".2f", "x"),
         fmt(r["route_vs_ping_p99"], ".2f", "x"), fmt(r["round_trips_per_route"], ".3f")]
        for r in data.get("latency", [])
    ]  # fmt: skip
    hits = data.get("hit_rate", {})
    everyone = [hits.get("oracle"), hits.get("oracle_bounded"), *hits.get("policies", []),
                hits.get("tiered")]  # fmt: skip
    policies = [
        [p["policy"], fmt(p["hit_ratio"], ".3f"), fmt(p["vs_oracle"], ".3f", "x"),
         fmt(p.get("load_max_over_avg_peak"), ".2f")]
        for p in everyone
        if p
    ]  # fmt: skip
    return [
        "Decision latency of one Router replica against Redis PING on the same connection "
        "(interleaved), and the prefix-hit ratio of each policy against a cache-aware oracle "
        f"(upper bound with an unlimited cache: {fmt(hits.get('upper_bound_hit_ratio'), '.3f')}).",
        "",
        *table(LATENCY_HEADER, latency),
        "",
        *table(["policy", "hit ratio", "/oracle", "load max/avg peak"], policies),
        *_router_residency(data.get("residency")),
        *_router_scale(data.get("scale", [])),
    ]


def _router_residency(r: Json | None) -> list[str]:
    """Placement by the workers' reported caches against the router's own cache model."""
    if not r:
        return []
    body = [
        [r[name]["policy"], fmt(r[name]["hit_ratio"], ".3f"), fmt(vs, ".3f", "x"),
         fmt(r[name]["load_max_over_avg_peak"], ".2f")]
        for name, vs in (("reported", r["reported_vs_oracle"]),
                         ("modelled", r["modelled_vs_oracle"]), ("oracle", 1.0))
    ]  # fmt: skip
    share = r["run_blocks"] / max(1, r["best_run_blocks"])
    return [
        "",
        f"The same workload with workers whose caches evict all the time and {r['restarts']} "
        "of which restart empty mid-run: `reported` places by the caches the workers report "
        f"(every {r['report_every']} placements), `modelled` by the router's own model of "
        "them, `oracle` greedily on the true caches under the same bound. Reported / "
        f"modelled: {fmt(r['reported_vs_modelled'], '.3f', 'x')}; the reporting router's "
        f"picks held {fmt(share, '.3f')} of the leading blocks the best candidate held.",
        "",
        *table(["placement", "hit ratio", "/bounded oracle", "load max/avg peak"], body),
    ]


def _router_scale(rows: list[Json]) -> list[str]:
    """Router replicas on one Redis: pdserve's shared state against per-replica state."""
    if not rows:
        return []
    body = [
        [r["design"], str(r["replicas"]), fmt(r["route"]["p99_ms"], ".2f"),
         fmt(r["ping"]["p99_ms"], ".2f"), fmt(r["round_trips_per_request"], ".3f"),
         str(r["over_bound"]), fmt(r["load_max_over_avg_peak"], ".2f"),
         fmt(r["load_max_over_avg_mean"], ".2f"), fmt(r["hit_ratio"], ".3f"),
         fmt(r.get("vs_oracle"), ".3f", "x")]
        for r in rows
    ]  # fmt: skip
    return [
        "",
        "Router replicas (one process each, as each gateway is) placing the same workload "
        "against one Redis: `shared` is pdserve (one load ledger and cache model), "
        "`per_replica` the same router with one namespace per replica (each counts and "
        "models only its own placements). Load max/avg is the cluster's true in-flight "
        "load, sampled from Redis; `over bound` counts placements whose worker was not "
        "under the bound as its own script saw it.",
        "",
        *table(["design", "replicas", "route p99 ms", "PING p99 ms", "RT/request",
                "over bound", "load max/avg peak", "mean", "hit ratio", "/oracle"], body),
    ]  # fmt: skip


def gateway(data: Json) -> list[str]:
    return table(
        ["gateway TTFT p50 ms", "direct Prefill p50 ms", "overhead ms", "paired median ms",
         "target ms", "pairs"],
        [[fmt(data.get("gateway_ttft_p50_ms")), fmt(data.get("direct_prefill_p50_ms")),
          fmt(data.get("overhead_p50_ms")), fmt(data.get("overhead_paired_p50_ms")),
          f"<= {fmt(data.get('target_ms'), 'g')}", str(data.get("reps", "-"))]],
    )  # fmt: skip


def tracing(data: Json) -> list[str]:
    on, off = data.get("tracing_on", {}), data.get("tracing_off", {})
    return table(
        ["tok/s on", "tok/s off", "throughput on/off", "TTFT p50 on/off", "cost", "target",
         "spans"],
        [[fmt(on.get("output_tokens_per_s"), ".1f"), fmt(off.get("output_tokens_per_s"), ".1f"),
          fmt(data.get("throughput_ratio_on_off"), ".3f", "x"),
          fmt(data.get("ttft_p50_ratio_on_off"), ".3f", "x"),
          fmt(100 * (num(data.get("throughput_cost")) or 0.0), ".1f", "%"),
          f"<= {fmt(100 * (num(data.get('target_cost')) or 0.0), '.0f', '%')}",
          str(data.get("spans_exported", "-"))]],
    )  # fmt: skip


def headline(data: Json) -> list[str]:
    rows = [
        [f"{c['rate']:g}", fmt(c.get("disaggregated_goodput"), ".3f"),
         fmt(c.get("disaggregated_attainment")), fmt(c.get("colocated_goodput"), ".3f"),
         fmt(c.get("colocated_attainment")), fmt(c.get("goodput_ratio"), ".2f", "x")]
        for c in data.get("comparisons", [])
    ]  # fmt: skip
    capacities = [
        f"- {s['name']}: capacity {fmt(s.get('capacity_rate'), '.3f')} req/s "
        f"({s.get('capacity_qualifier', '')})"
        for s in data.get("systems", [])
    ]
    return [
        "Disaggregated (1 prefill + 1 decode) against colocated (2 mixed) workers, one core "
        "each, on the long-prompt mix; capacity = the highest rate holding the attainment "
        "target.",
        "",
        *table(HEADLINE_HEADER, rows),
        "",
        *capacities,
        f"- capacity ratio disaggregated / colocated: "
        f"{fmt(data.get('capacity_ratio'), '.2f', 'x')}; short prompts only, goodput ratio "
        f"{fmt(data.get('short_only_goodput_ratio'), '.2f', 'x')}",
    ]


def sweep(data: Json) -> list[str]:
    rows = [
        [p["label"], str(p["metrics"]["sent"]), str(p["metrics"]["ok"]),
         fmt(p["metrics"]["goodput"], ".3f"), fmt(p["metrics"]["slo_attainment"]),
         fmt(p["metrics"]["ttft_ms"]["p50"], ".0f"), fmt(p["metrics"]["itl_ms"]["p50"], ".0f")]
        for p in data.get("points", [])
    ]  # fmt: skip
    return table(
        ["point", "sent", "ok", "goodput req/s", "attainment", "TTFT p50 ms", "ITL p50 ms"], rows
    )


def _counts(counts: object) -> str:
    if not isinstance(counts, dict) or not counts:
        return "-"
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def _ms3(dist: object, keys: tuple[str, str, str] = ("p50_ms", "p90_ms", "max_ms")) -> str:
    d = dist if isinstance(dist, dict) else {}
    return " / ".join(fmt(d.get(k), ".0f") for k in keys)


def overload(data: Json) -> list[str]:
    cap = data.get("capacity", {})
    run = data.get("overload", {})
    cfg = data.get("config", {})
    rows = [
        [c["priority"], fmt(c.get("budget_s"), "g"), str(c.get("offered", "-")),
         str(c.get("served", "-")), fmt(c.get("attainment")), _counts(c.get("refused_by_status")),
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
        f"Capacity {fmt(cap.get('capacity_rate'), '.3f')} req/s ({cap.get('qualifier', '?')}; "
        f"the highest Poisson rate of the class mix `{cfg.get('class_mix', '?')}` "
        f"(critical, standard, sheddable) holding {fmt(cfg.get('attainment_target'), 'g')} "
        f"attainment), then {fmt(cfg.get('overload_factor'), 'g')}x that "
        f"({fmt(data.get('overload_rate'), '.3f')} req/s) for "
        f"{fmt(run.get('duration_s'), 'g')} s. A request meets its SLO when it completes "
        "with its first token within its class's TTFT budget.",
        "",
        *table(header, rows),
        "",
        f"- goodput under overload {fmt(run.get('goodput', {}).get('requests_per_s'), '.3f')} "
        f"req/s against {fmt(data.get('goodput_at_capacity_rps'), '.3f')} req/s at capacity: "
        f"**{fmt(data.get('goodput_ratio'), '.2f', 'x')}**",
        f"- leak check after the run: {'clean' if leaks.get('clean') else '**not clean**'}",
    ]


def decode_overload(data: Json) -> list[str]:
    """Both deployments of the decode-heavy overload, per class, with their ITL."""
    cap = data.get("capacity", {})
    header = ["deployment", "class", "offered", "served", "attainment", "refused by reason",
              "TTFT ms p50 / p90 / max", "ITL ms p50 / p90 / max",
              "goodput / capacity"]  # fmt: skip
    rows = []
    for name, key in (("ITL admission off", "baseline"), ("ITL admission on", "itl_admission")):
        d = data.get(key, {})
        for c in d.get("overload", {}).get("classes", []):
            rows.append([
                f"{name} ({fmt(d.get('itl_budget_s'), 'g')} s)", c["priority"],
                str(c.get("offered", "-")), str(c.get("served", "-")), fmt(c.get("attainment")),
                _counts(c.get("refused_by_reason")), _ms3(c.get("ttft")), _ms3(c.get("itl")),
                fmt(d.get("goodput_ratio"), ".2f", "x"),
            ])  # fmt: skip
    return [
        f"Unloaded decode step {fmt(data.get('unloaded_step_ms'), '.1f')} ms; ITL SLO "
        f"{fmt(data.get('itl_slo_ms'), 'g')} ms (the p90 of a request's own token gaps). "
        f"Capacity {fmt(cap.get('capacity_rate'), '.3f')} req/s ({cap.get('qualifier', '?')}), "
        f"then {fmt(data.get('overload_rate'), '.3f')} req/s offered to each deployment; "
        f"critical ITL p90 **{fmt(data.get('critical_itl_p90_ms'), '.0f')} ms** with ITL "
        f"admission against {fmt(data.get('critical_itl_p90_ms_baseline'), '.0f')} ms "
        "without.",
        "",
        *table(header, rows),
        *_paired_rounds(data.get("itl_admission", {})),
    ]


def _paired_rounds(d: Json) -> list[str]:
    """The ITL-admission deployment's paired rounds (capacity run, then overload)."""
    rounds = d.get("rounds") or []
    if not rounds:
        return []
    ratios = ", ".join(
        f"{fmt(r.get('overload_goodput_rps'), '.3f')} / {fmt(r.get('capacity_goodput_rps'), '.3f')}"
        for r in rounds
    )
    return [
        "",
        f"Goodput ratio with ITL admission: **{fmt(d.get('goodput_ratio'), '.2f', 'x')}**, the "
        f"median of {len(rounds)} paired rounds on one cluster, each the overload's goodput "
        f"over that round's goodput at the capacity rate (the rate times the attainment of "
        f"its run there), req/s: {ratios}. The baseline's ratio is its one overload run "
        "against the search's probe at capacity.",
    ]


def fairness(data: Json) -> list[str]:
    rows = [
        [p["label"], t["tenant"], str(t.get("offered", "-")), str(t.get("served", "-")),
         fmt(t.get("attainment")), fmt(t.get("kv_block_seconds"), ".0f"),
         fmt(t.get("ttft", {}).get("p50_ms"), ".0f")]
        for p in data.get("phases", [])
        for t in p.get("tenants", [])
    ]  # fmt: skip
    iso = [
        [i["tenant"], f"{i['noisy_phase']} / {i.get('alone_phase', 'alone')}",
         fmt(i.get("alone_attainment")),
         fmt(i.get("noisy_attainment")), fmt(i.get("ratio"), ".2f", "x")]
        for i in data.get("isolation", [])
    ]  # fmt: skip
    jain = [[label, fmt(value, ".3f")] for label, value in data.get("kv_jain", {}).items()]
    cfg = data.get("config", {})
    return [
        f"Tenants A, B, C (standard, weight 1), each share "
        f"{fmt(data.get('share_rate'), '.3f')} req/s; A sends "
        f"{fmt(cfg.get('noisy_factor'), 'g')} shares in the noisy phases; all send "
        f"{fmt(cfg.get('backlog_factor'), 'g')} in the backlogged ones. `_2gw`: A through "
        "gateway 0, B and C through gateway 1 (shared Redis and workers).",
        "",
        *table(FAIRNESS_HEADER, rows),
        "",
        *table(["tenant", "phases", "alone attainment", "noisy attainment", "ratio"], iso),
        "",
        *table(["backlogged phase", "Jain's index of KV-block-seconds"], jain),
    ]
