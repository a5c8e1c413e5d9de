"""Sections of docs/benchmarks.md for issue 41's two system benchmarks: the shifting
workload (elastic P/D roles against the static 1P+1D split and colocated workers as the
mix of chat and long prompts shifts) and the peer (pdserve against llama.cpp's
llama-server on the same host, weights, client and workload).

Lifecycle: `sections.SECTIONS` maps each schema to one renderer here; `sections.section`
calls it with the result file's JSON and adds the heading, provenance and targets around
its lines (a stale result's "not current" too). A renderer only reads the file: the
ratios it prints are the medians of paired rounds each benchmark stored, beside the
rounds they were taken over, never recomputed here.
"""

from __future__ import annotations

from loadtest.reports.markdown import Json, dicts, fmt, mapping, num, table

SHIFT_PHASE_HEADER = ("rate scale", "phase", "deployment", "rounds", "sent", "attainment",
                      "goodput req/s", "TTFT ms p50 / p90", "ITL ms p50 / p90")  # fmt: skip
PEER_HEADER = ("streams", "server", "output tok/s", "round by round", "TTFT p50 ms",
               "ITL p50 ms", "TPOT p50 ms", "errors")  # fmt: skip
PEER_RATIO_HEADER = ("streams", "output tok/s ratio", "TTFT p50 ratio", "ITL p50 ratio",
                     "errors pdserve / llama.cpp")  # fmt: skip
BEST = "best"  # a shifting ratio's `other`: the better of the other deployments, per round


def _phase_names(data: Json) -> list[str]:
    """'1 chat', '2 50% long', ...: the shifting workload's phases, in order."""
    names = []
    for k, phase in enumerate(dicts(data.get("phases"))):
        share = num(phase.get("long_fraction"))
        names.append(f"{k + 1} {f'{share:.0%} long' if share else 'chat'}")
    return names


def _deployment(system: Json) -> str:
    """'elastic (1P+1D)' or 'colocated (2 mixed)', from the deployment's cluster."""
    cluster = mapping(system.get("cluster"))
    prefill, decode = cluster.get("num_prefill"), cluster.get("num_decode")
    shape = f"{prefill}P+{decode}D" if prefill else f"{decode} mixed"
    return f"{system.get('name', '?')} ({shape})"


def _shift_intro(data: Json) -> list[str]:
    """The deployments, how the rounds pair, the schedule, and the SLO as measured."""
    cfg, slo = mapping(data.get("config")), mapping(data.get("slo"))
    systems = dicts(data.get("systems"))
    schedule = "; ".join(
        f"{name} {fmt(p.get('start_s'), 'g')}-{fmt(p.get('end_s'), 'g')} s at "
        f"{fmt(p.get('rate'), 'g')} req/s"
        for name, p in zip(_phase_names(data), dicts(data.get("phases")), strict=True)
    )
    derived = (
        f" ({fmt(cfg.get('itl_slo_step_factor'), 'g')}x the unloaded decode step measured "
        "in the run)"
        if num(cfg.get("itl_slo_ms")) == 0
        else ""
    )
    steps = ", ".join(
        f"{s.get('name')} {fmt(s.get('unloaded_step_ms'), '.0f')} ms" for s in systems
    )
    quantile = fmt(100 * (num(slo.get("itl_quantile")) or 0.0), ".0f")
    return [
        f"Deployments {', '.join(_deployment(s) for s in systems)}, one core and one torch "
        "thread per worker; the first is held against the others. Each round draws one "
        "Poisson request sequence over the whole schedule and runs it on every deployment "
        f"in turn, the order reversing every round: {cfg.get('rounds', '?')} paired round(s) "
        f"per rate scale ({cfg.get('rate_scales', '?')}). Phases at rate scale 1: {schedule}.",
        "",
        f"SLO: TTFT <= {fmt(slo.get('ttft_ms'), 'g')} ms + "
        f"{fmt(slo.get('ttft_ms_per_token'), 'g')} ms per prompt token; p{quantile} of each "
        f"request's inter-token gaps <= {fmt(slo.get('itl_ms'), 'g')} ms{derived}. Unloaded "
        f"decode step: {steps}. Goodput = requests within the SLO per second; errors count "
        "as misses.",
    ]


def _shift_ratio_rows(data: Json) -> list[list[str]]:
    """The first deployment's goodput over each other one's and over the better of them:
    each paired round's ratio (whole schedule), then the medians, whole and per phase."""
    systems = dicts(data.get("systems"))
    first = str(systems[0].get("name")) if systems else "?"
    return [
        [f"{first} / {'the better other' if r.get('other') == BEST else r.get('other')}",
         fmt(r.get("scale"), "g"),
         ", ".join(fmt(x, ".2f", "x") for x in r.get("rounds") or []) or "-",
         fmt(r.get("whole"), ".2f", "x"), *(fmt(x, ".2f", "x") for x in r.get("phases") or [])]
        for r in dicts(data.get("ratios"))
    ]  # fmt: skip


def _shift_phase_rows(data: Json) -> list[list[str]]:
    """Per rate scale, each phase then the whole schedule, each deployment: the medians
    over rounds."""
    systems = dicts(data.get("systems"))
    by_scale = [(str(s.get("name")), q) for s in systems for q in dicts(s.get("scales"))]
    rows = []
    for scale in sorted({x for _, q in by_scale if (x := num(q.get("scale"))) is not None}):
        at_scale = [(name, q) for name, q in by_scale if num(q.get("scale")) == scale]
        for k, phase in enumerate([*_phase_names(data), "whole"]):
            for name, q in at_scale:
                parts = dicts(q.get("phases"))
                ph = parts[k] if k < len(parts) else mapping(q.get("whole"))
                rows.append([
                    f"{scale:g}", phase, name, str(q.get("rounds", "-")), str(ph.get("sent", "-")),
                    fmt(ph.get("attainment")), fmt(ph.get("goodput"), ".3f"),
                    f"{fmt(ph.get('ttft_p50_ms'), '.0f')} / {fmt(ph.get('ttft_p90_ms'), '.0f')}",
                    f"{fmt(ph.get('itl_p50_ms'), '.0f')} / {fmt(ph.get('itl_p90_ms'), '.0f')}",
                ])  # fmt: skip
    return rows


def shifting(data: Json) -> list[str]:
    """Elastic roles against the static split and colocated workers as the mix shifts:
    the judged ratio, the paired rounds' goodput ratios and each phase's medians."""
    capacities = [
        f"- capacity of {s.get('name')}: rate scale {fmt(s.get('capacity_scale'), '.3f')} "
        f"({s.get('capacity_qualifier', '')})"
        for s in dicts(data.get("systems"))
        if num(s.get("capacity_scale")) is not None
    ]
    header = ["goodput", "rate scale", "whole: round by round", "whole: median",
              *(f"{name}: median" for name in _phase_names(data))]  # fmt: skip
    return [
        *_shift_intro(data),
        "",
        f"- judged ratio **{fmt(data.get('ratio'), '.2f', 'x')}**: "
        f"{data.get('ratio_basis') or 'none yet'}",
        *capacities,
        "",
        "Goodput ratios: each paired round's over the whole schedule, then the medians of "
        "the paired rounds, whole and per phase (- where the other had no goodput):",
        "",
        *table(header, _shift_ratio_rows(data)),
        "",
        "Per phase, medians over rounds:",
        "",
        *table(SHIFT_PHASE_HEADER, _shift_phase_rows(data)),
    ]


def _peer_rounds(data: Json, server: object, streams: object) -> str:
    """One server's output tok/s at one point, round by round, as the file lists them."""
    mine = [r for r in dicts(data.get("rounds"))
            if r.get("server") == server and r.get("streams") == streams]  # fmt: skip
    mine.sort(key=lambda r: num(r.get("round")) or 0.0)
    return ", ".join(fmt(r.get("output_tok_s"), ".1f") for r in mine) or "-"


def _peer_gaps(data: Json) -> list[str]:
    """Where pdserve's 1-stream inter-token gap goes, against llama-server's own."""
    g = mapping(data.get("gap_breakdown"))
    if not g:
        return []
    share = fmt(100 * (num(g.get("serving_path_share")) or 0.0), ".0f", "%")
    rows = [
        ["pdserve TPOT p50 over HTTP (what the client sees)", fmt(g.get("tpot_http_ms"))],
        ["pdserve TPOT p50 over gRPC", fmt(g.get("tpot_grpc_ms"))],
        ["decode worker's step (its load signal)", fmt(g.get("decode_step_ms"))],
        ["serving path = TPOT - step", f"{fmt(g.get('serving_path_ms'))} ({share} of the TPOT)"],
        ["of it: the HTTP front door (TPOT HTTP - TPOT gRPC)", fmt(g.get("http_front_door_ms"))],
        ["of it: engine loop, worker and gateway gRPC (TPOT gRPC - step)",
         fmt(g.get("grpc_path_ms"))],
        ["llama-server TPOT p50", fmt(g.get("llama_tpot_ms"))],
        ["llama-server's own time per generated token", fmt(g.get("llama_ms_per_token"))],
        ["llama-server's serving path (TPOT - its own time)", fmt(g.get("llama_serving_path_ms"))],
    ]  # fmt: skip
    return ["", "Where pdserve's 1-stream inter-token gap goes (medians over rounds):", "",
            *table(["part", "ms"], rows)]  # fmt: skip


def peer(data: Json) -> list[str]:
    """pdserve against llama.cpp's llama-server: each server's medians over rounds, the
    paired rounds' median ratios, and where the 1-stream gap goes."""
    cfg = mapping(data.get("config"))
    rows = [
        [str(s.get("streams")), str(s.get("server")), fmt(s.get("output_tok_s"), ".1f"),
         _peer_rounds(data, s.get("server"), s.get("streams")), fmt(s.get("ttft_p50_ms"), ".0f"),
         fmt(s.get("itl_p50_ms"), ".1f"), fmt(s.get("tpot_p50_ms"), ".1f"),
         str(s.get("errors", "-"))]
        for s in dicts(data.get("summaries"))
    ]  # fmt: skip
    ratios = [
        [str(c.get("streams")), fmt(c.get("output_tok_s_ratio"), ".2f", "x"),
         fmt(c.get("ttft_p50_ratio"), ".2f", "x"), fmt(c.get("itl_p50_ratio"), ".2f", "x"),
         f"{c.get('pdserve_errors', '-')} / {c.get('llama_errors', '-')}"]
        for c in dicts(data.get("comparisons"))
    ]  # fmt: skip
    return [
        f"pdserve: {data.get('pdserve_cluster', '?')}. llama.cpp's llama-server "
        f"(llama-cpp-python {data.get('llama_cpp_python_version', '?')}): "
        f"{cfg.get('llama_threads', '?')} threads, {cfg.get('llama_slots', '?')} slots. Both "
        "on the same host with the same weights, client and workload: chat-shaped prompts of "
        f"about {cfg.get('prompt_tokens', '?')} tokens, {cfg.get('output_tokens', '?')} output "
        "tokens each (greedy), `/v1/completions` streamed, closed loop at each point's "
        f"number of streams; {cfg.get('rounds', '?')} paired rounds, who goes first "
        "alternating. Per server the medians over rounds, its output tok/s round by round "
        "beside; each ratio pdserve / llama.cpp is the median of the paired rounds' ratios.",
        "",
        *table(PEER_HEADER, rows),
        "",
        *table(PEER_RATIO_HEADER, ratios),
        *_peer_gaps(data),
    ]
