"""The `pdserve generate --trace` table: a request's phases from its final message.

The gateway puts every phase it and the workers measured (wall-clock start and end, and
who measured it) on the last GenerateResponse; this renders them in start order with
offsets from the start of `gateway.generate`, so queueing, prefill, the KV transfer and
decode read off at a glance.
"""

from __future__ import annotations

from pdserve.v1 import gateway_pb2

ROOT_PHASE = "gateway.generate"


def format_timeline(msg: gateway_pb2.GenerateResponse) -> str:
    """A small fixed-width table; says so when the gateway sent no phases."""
    if not msg.phases:
        return "no phase timings (the gateway predates them)"
    phases = sorted(msg.phases, key=lambda p: (p.start_unix_nano, p.name != ROOT_PHASE))
    origin = next(
        (p.start_unix_nano for p in phases if p.name == ROOT_PHASE), phases[0].start_unix_nano
    )
    lines = [
        f"trace {msg.trace_id or '(tracing off)'}",
        f"{'phase':<20}{'where':<12}{'start ms':>10}{'duration ms':>13}",
    ]
    for p in phases:
        start_ms = (p.start_unix_nano - origin) / 1e6
        duration_ms = (p.end_unix_nano - p.start_unix_nano) / 1e6
        where = p.worker_id or "gateway"
        lines.append(f"{p.name:<20}{where:<12}{start_ms:>10.2f}{duration_ms:>13.2f}")
    return "\n".join(lines)
