"""Sections of docs/benchmarks.md for the benchmarks of one engine in-process: decode
throughput, the roofline, the accuracy gate, 8-bit KV and offload, speculative decoding,
multi-LoRA, structured output.

Lifecycle: `sections.SECTIONS` maps each schema to one renderer here; `sections.section`
calls it with the result file's JSON and adds the heading, provenance and targets around
its lines. A renderer only reads the file.
"""

from __future__ import annotations

import statistics

from loadtest.reports.markdown import Json, dicts, fmt, mapping, num, table


def _side_tps(phase: Json, side: str) -> str:
    return fmt((phase.get(side) or {}).get("tokens_per_s"), ".1f")


def _verdict(ratio: object, met: object) -> str:
    if num(ratio) is None:
        return "-"
    return fmt(ratio, ".2f", "x") + ("" if met is None else "" if met else " (**not met**)")


def engine(data: Json) -> list[str]:
    rows = [
        [str(p["batch_size"]), str(p["num_requests"]), fmt(p["pdserve"]["tokens_per_s"], ".1f"),
         fmt(p["transformers"]["tokens_per_s"], ".1f"), fmt(p["ratio"], ".2f", "x"),
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
        *table(header, rows),
        "",
        f"KV pool: {kv.get('total_blocks', '?')} blocks x {kv.get('block_size', '?')} tokens, "
        f"{fmt(kv.get('pool_mib'), '.1f')} MiB; {kv.get('bytes_per_token', '?')} bytes/token.",
    ]


def structured(data: Json) -> list[str]:
    """Per-step cost of structured output and logit processing at one batch size."""
    rows = [
        [
            str(b.get("name")),
            fmt(num(b.get("median_ms")), ".1f"),
            fmt(num(b.get("ratio")), ".2f", "x"),
            str(len(b.get("step_ms") or [])),
        ]
        for b in dicts(data.get("batches"))
    ]
    mask = fmt(num(data.get("mask_ms_per_step")), ".2f")
    return [
        f"Batch of {data.get('batch')} decoding requests; {data.get('note', '')}.",
        "",
        *table(["batch", "median step ms", "ratio to plain", "steps timed"], rows),
        "",
        f"Grammar masks of the constrained rows, timed alone: {mask} ms per step.",
    ]


def roofline(data: Json) -> list[str]:
    """The engine's prefill and decode GFLOPS as fractions of roofs measured in the run."""
    rows = []
    for r in data.get("precisions", []):
        name = f"{r['name']} (peak {fmt(r.get('peak_gflops'), '.0f')})"
        for p in r.get("prefill", []):
            rows.append([name, f"prefill {p['tokens']} tokens", fmt(p["tokens_per_s"], ".0f")
                         + " tok/s", fmt(p["gflops"], ".1f"), fmt(p.get("kernel_gflops"), ".0f"),
                         fmt(p["roof_gflops"], ".0f"), fmt(p["fraction"], ".2f")])  # fmt: skip
        for d in r.get("decode", []):
            rows.append([name, f"decode batch {d['batch']}", fmt(d["step_ms"], ".1f")
                         + " ms/step", fmt(d["gflops"], ".1f"), fmt(d.get("kernel_gflops"), ".0f"),
                         fmt(d["roof_gflops"], ".0f"), fmt(d["fraction"], ".2f")])  # fmt: skip
        rows.append([name, "batch-1 bandwidth bound", fmt(r.get("bandwidth_bound_ms"), ".1f")
                     + " ms", "-", "-", "-", fmt(r.get("bandwidth_fraction"), ".2f")])  # fmt: skip
    header = ["precision (peak GFLOPS)", "work", "speed", "GFLOPS", "kernel GFLOPS",
              "roof GFLOPS", "fraction"]  # fmt: skip
    return [
        f"{data.get('threads', '?')} torch thread(s); read bandwidth "
        f"{fmt(data.get('bandwidth_gb_s'), '.1f')} GB/s. {data.get('note', '')}.",
        "",
        *table(header, rows),
    ]


def _accuracy_rows(modes: list[Json]) -> list[list[str]]:
    return [
        [m["name"], fmt(m["perplexity"], ".3f"), fmt(100 * m["ppl_rise"], "+.2f", "%"),
         f"<= +{100 * m['max_ppl_rise']:.0f}%", fmt(m["forced_agreement"], ".3f"),
         f">= {m['min_agreement']:.2f}", fmt(m["agreement"], ".3f"),
         fmt(m["prefix_agreement"], ".3f"), fmt(m.get("yardstick_agreement"), ".3f"),
         _floor(m.get("free_floor")), "pass" if m["passed"] else "**fail**"]
        for m in modes
    ]  # fmt: skip


def _floor(value: object) -> str:
    return "-" if value is None else f">= {fmt(value, '.3f')}"


def accuracy(data: Json) -> list[str]:
    """Perplexity and agreement of each reduced-precision mode against float32, each
    held to its yardstick where the run scored one, and the yardsticks themselves."""
    header = ["mode", "perplexity", "rise", "bound", "forced agreement", "floor",
              "free agreement", "free prefix", "yardstick's free", "free floor",
              "gate"]  # fmt: skip
    lines = [
        f"{data.get('reference_tokens', '?')} reference tokens, {data.get('prompts', '?')} "
        f"parity prompts, {data.get('continuation_tokens', '?')} tokens each. "
        f"{data.get('note', '')}.",
        "",
        *table(header, _accuracy_rows(data.get("modes", []))),
    ]
    if data.get("reference"):
        lines += [
            "",
            "The yardsticks, same run and inputs: a reference implementation of each mode "
            "against transformers' own float32, scored the same way (the gate column says "
            "whether it would pass the mode's bounds). transformers' float32 continuations "
            f"equal the float32 engine's on {data.get('reference_fp32_same', '?')} of "
            f"{data.get('prompts', '?')} prompts.",
            "",
            *table(header, _accuracy_rows(data["reference"])),
        ]
    for name, why in (data.get("unavailable") or {}).items():
        lines += ["", f"Not measured: {name} ({why})."]
    return lines


def kv_memory(data: Json) -> list[str]:
    capacity = [
        [c["cache"], c["stored_dtype"], str(c["bytes_per_block"]), str(c["blocks"]),
         fmt(c["vs_bfloat16"], ".2f", "x"), fmt(c["vs_float32"], ".2f", "x")]
        for c in data.get("capacity", [])
    ]  # fmt: skip
    throughput = [
        [t["cache"], fmt(t["tokens_per_s"], ".1f"), fmt(t["vs_unquantized"], ".2f", "x"),
         ", ".join(fmt(x, ".1f") for x in t["rounds_tokens_per_s"]),
         ", ".join(fmt(x, ".2f", "x") for x in t.get("round_ratios", [])) or "-",
         fmt(t.get("median_round_ratio"), ".2f", "x")]
        for t in data.get("throughput", [])
    ]  # fmt: skip
    o = data.get("offload") or {}
    offload = (
        [f"Offload: a {o['prompt_tokens']}-token prompt evicted from a {o['pool_blocks']}-block "
         f"pool; TTFT recomputed {o['recompute_ttft_s']} s, restored from a "
         f"{o['tier_blocks']}-block tier {o['tier_ttft_s']} s ({o['restored_blocks']} blocks "
         f"restored): {fmt(o['ttft_ratio'], '.3f')}x."]
        if o else []
    )  # fmt: skip
    return [
        f"KV cache dtypes and the offload tier; compute {data.get('compute_dtype')}, "
        f"{data.get('threads')} thread(s). Capacity of "
        f"{fmt(data.get('capacity_bytes', 0) / 2**20, '.0f')} MiB:",
        "",
        *table(["cache", "stored", "bytes/block", "blocks", "/bf16", "/fp32"], capacity),
        "",
        "Output tokens/s at batch 32 (best of rounds, each run in its own process, order rotated):",
        "",
        *table(
            ["cache", "tok/s", "/unquantized", "rounds", "round by round", "median"], throughput
        ),
        "",
        *offload,
    ]


def speculation(data: Json) -> list[str]:
    rows = [
        [w["workload"], str(w["requests"]), fmt(w["off_tokens_per_s"], ".1f"),
         fmt(w["spec_tokens_per_s"], ".1f"), fmt(w["ratio"], ".2f", "x"),
         fmt(w.get("paired_ratio"), ".2f", "x"), fmt(w["acceptance_rate"], ".2f"),
         fmt(w["tokens_per_verification"], ".2f")]
        for w in data.get("workloads", [])
    ]  # fmt: skip
    head = ["workload", "requests", "off tok/s", "auto tok/s", "auto/off",
            "median of paired rounds", "acceptance", "tokens/verification"]  # fmt: skip
    return [
        f"Decode tokens/s at batch 1, {data.get('max_tokens')} tokens per request, compute "
        f"{data.get('compute_dtype')}, {data.get('threads')} thread(s); best of "
        f"{data.get('reps')} interleaved rounds per side, and the median over rounds of the "
        "ratio within each. `repetitive` and `chat` are greedy with EOS ignored (chat's "
        "small-model answers then loop, which drafts predict); `open` samples new prose "
        "for eight distinct requests, the workload that does not repeat itself. "
        "Speculation `auto`: prompt-lookup drafts with adaptive length.",
        "",
        *table(head, rows),
    ]


def lora(data: Json) -> list[str]:
    """One batch on the base model against the same batch mixing four LoRA adapters."""
    rows = [
        [
            str(s.get("name")),
            fmt(num(s.get("tokens_per_s")), ".1f"),
            fmt(num(s.get("ratio")), ".2f", "x"),
            fmt(num(s.get("paired_ratio")), ".2f", "x"),
            fmt(num(s.get("step_ms")), ".1f"),
        ]
        for s in dicts(data.get("sides"))
    ]
    return [
        f"Batch of {data.get('batch')} greedy requests, {data.get('max_tokens')} tokens each, "
        f"{data.get('compute_dtype')}; a mixed batch spreads its requests over "
        f"{data.get('adapters_per_batch')} adapters of one shape (every step mixes them all). "
        "Shapes: `qv-r8` is PEFT's default for Llama (q and v, rank 8), `all-linear-r16` every "
        "projection at rank 16. Tokens/s over prefill and decode, best round of each; the "
        "median of paired rounds beside it (a result from before it has none: -).",
        "",
        *table(
            ["batch", "tokens/s", "ratio to base", "median of paired rounds", "decode step ms"],
            rows,
        ),
    ]


def invariance(data: Json) -> list[str]:
    """Rows whose bits depend on their batch, per linear kernel, and a fixed tile's cost."""
    cfg = mapping(data.get("config"))
    sizes = [str(b) for b in cfg.get("batch_sizes", [])]
    rows = [
        [str(d.get("dtype")), str(d.get("kernel")), "tiled" if d.get("tiled") else "plain",
         str(d.get("projection")), *(str(mapping(d.get("by_batch")).get(b, "")) for b in sizes)]
        for d in dicts(data.get("differing"))
    ]  # fmt: skip
    costs = [
        [str(c.get("dtype")), str(c.get("kernel")), str(c.get("rows")),
         fmt(num(c.get("plain_ms")), ".1f"), fmt(num(c.get("tiled_ms")), ".1f"),
         fmt(num(c.get("ratio")), ".2f", "x")]
        for c in dicts(data.get("costs"))
    ]  # fmt: skip
    return [
        f"Rows of a random batch whose output differs in any bit from the same row alone "
        f"(of as many rows as the batch has), one torch thread; `tiled` runs every product "
        f"as whole tiles of {cfg.get('tile_rows')} rows. CPU with native bf16: "
        f"{data.get('native_bf16')}.",
        "",
        *table(["dtype", "kernel", "", "projection", *(f"batch {b}" for b in sizes)], rows),
        "",
        "The tile's cost: one layer's projections and the LM head, median of paired rounds.",
        "",
        *table(["dtype", "kernel", "rows", "plain ms", "tiled ms", "tiled / plain"], costs),
    ]


PHASE_HEADER = ("batch", "requests", "off tok/s (median)", "on tok/s (median)",
                "on, per round", "on / off (median of rounds)", "best / best")  # fmt: skip


PHASE_HEADER = ("batch", "requests", "off tok/s (median)", "on tok/s (median)",
                "on, per round", "on / off (median of rounds)", "best / best")  # fmt: skip


def tiled(data: Json) -> list[str]:
    """The engine's throughput with batch invariance on over off, and whether a request's
    log-probabilities change with its batch under each."""
    phases = [
        [str(p.get("batch_size")), str(p.get("requests")),
         fmt(_median(p.get("default_tps")), ".1f"), fmt(_median(p.get("tiled_tps")), ".1f"),
         ", ".join(fmt(num(t), ".1f") for t in p.get("tiled_tps") or []),
         fmt(num(p.get("ratio_median")), ".2f", "x"), fmt(num(p.get("ratio_best")), ".2f", "x")]
        for p in dicts(data.get("phases"))
    ]  # fmt: skip
    checks = [
        [str(i.get("side")), str(i.get("logprobs")), str(i.get("differing"))]
        for i in dicts(data.get("invariance"))
    ]
    return [
        "float32 engines with `--batch-invariant off` (oneDNN, SDPA) and on (the tiled linear "
        "kernel, attention by rows), on the engine benchmark's seeded workload; output tokens "
        "per second.",
        "",
        *table(PHASE_HEADER, phases),
        "",
        "Each request of the batch-8 phase alone against beside the phase's others: its "
        "token log-probabilities that differ in any bit:",
        "",
        *table(["batch_invariant", "log-probabilities", "differing"], checks),
    ]


def row_attention(data: Json) -> list[str]:
    """Attention by rows (batch invariance, float32) against SDPA per layer call, and the
    rows whose bits change with the batch or the chunking under each."""
    cases = [
        [str(c.get("kind")), f"{c.get('rows')} x {c.get('context')}",
         fmt(_median(c.get("sdpa_ms")), ".2f"), fmt(_median(c.get("rows_ms")), ".2f"),
         fmt(num(c.get("ratio_median")), ".2f", "x"),
         f"{c.get('sdpa_differing')} / {c.get('rows_differing')} of {c.get('rows')}"]
        for c in dicts(data.get("cases"))
    ]  # fmt: skip
    cfg = mapping(data.get("config"))
    return [
        "One layer's attention in float32 over a pool laid out as the engine's (SmolLM2's "
        "9 query and 3 KV heads, 16-token blocks), through the engine's own backend: SDPA "
        "(`--batch-invariant off`; decode rows grouped and padded) against rows "
        f"(`engine.row_attention`), {cfg.get('threads')} thread(s), median of "
        f"{cfg.get('rounds')} paired rounds. Decode: rows x context; prefill: one chunk's "
        "queries x the keys its last query sees. Differing rows: decode rows together "
        "against each alone, a prefill chunk in one call against in three.",
        "",
        *table(
            ["step", "shape", "SDPA ms", "rows ms", "rows / SDPA", "differing rows (SDPA / rows)"],
            cases,
        ),
    ]


def _median(values: object) -> float | None:
    listed = values if isinstance(values, list) else []
    got = [v for v in (num(x) for x in listed) if v is not None]
    return statistics.median(got) if got else None


def cache_fairness(data: Json) -> list[str]:
    """The hot tenant's prefix hit rate alone, under a flood, and under one shared list."""
    rows = [
        [str(m.get("mode")), fmt(num(m.get("hit_rate")), ".3f"),
         f"{m.get('hot_cached_tokens')}/{m.get('hot_prompt_tokens')}",
         str(m.get("flood_requests")), fmt(num(m.get("wall_s")), ".1f")]
        for m in dicts(data.get("modes"))
    ]  # fmt: skip
    return [
        f'Tenant "hot": one request a round with a {data.get("system_tokens")}-token '
        f'system prompt; tenant "flood": {data.get("flood_per_round")} unique '
        f"{data.get('flood_tokens')}-token prompts a round; a {data.get('pool_blocks')}-block "
        f'pool; {data.get("rounds")} rounds, deterministic (counts, not samples). "shared '
        "list\" counts both tenants' blocks as one tenant's: one least-recently-freed list, "
        "as before cache fairness.",
        "",
        *table(
            ["mode", "hot hit rate", "cached / prompt tokens", "flood requests", "wall s"], rows
        ),
        "",
        f"Fair / solo: {fmt(num(data.get('fair_vs_solo')), '.2f', 'x')}; shared list / solo: "
        f"{fmt(num(data.get('shared_vs_solo')), '.2f', 'x')}.",
    ]


def preemption(data: Json) -> list[str]:
    """Resume time after a preemption, by swap and by recompute, per context length."""
    rows = [
        [str(c.get("context")), fmt(_ms(c.get("swap_median_s")), ".1f"),
         str(c.get("swapped_tokens")), fmt(_ms(c.get("recompute_median_s")), ".1f"),
         str(c.get("recomputed_tokens")), fmt(num(c.get("paired_ratio")), ".2f", "x"),
         "yes" if c.get("same_tokens") else "**no**"]
        for c in dicts(data.get("contexts"))
    ]  # fmt: skip
    header = ["context", "swap ms", "tokens copied", "recompute ms", "tokens computed",
              "recompute / swap", "same tokens"]  # fmt: skip
    return [
        f"A sheddable request preempted by a critical one resumes; resume time from the "
        f"step that ends the critical request to the sheddable one's next token, medians "
        f"of {data.get('rounds')} paired rounds (ratio: median of the rounds' ratios).",
        "",
        *table(header, rows),
    ]


def _ms(seconds: object) -> float | None:
    value = num(seconds)
    return None if value is None else value * 1000
