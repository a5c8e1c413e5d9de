"""`pdserve usage`: the usage ledger's totals (or its entries) over a time range.

Reads the Redis Stream the gateways write (`services.gateway.access.usage_ledger`)
straight from Redis, so it works with every gateway stopped; the Redis holds every
tenant's usage, so whoever can run this can read all of it (docs/security.md).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import TextIO

import redis

from services.gateway.access.usage_ledger import UsageEntry, read, totals
from services.router.redis_client import connect

AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FORMATS = ("table", "csv", "json")
TOTAL_COLUMNS = ("tenant", "model", "adapter", "requests", "prompt_tokens", "cached_tokens",
                 "completion_tokens")  # fmt: skip


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = sub.add_parser("usage", help="token usage by tenant, model and adapter (the ledger)")
    usage.add_argument("--redis-url", required=True, help="the Redis the gateways write to")
    usage.add_argument("--namespace", default="pdserve", help="the cluster's key namespace")
    usage.add_argument(
        "--since", default="1d",
        help="requests that ended at or after this: an ISO time (UTC unless it says) or "
        "a span ago such as 90m, 24h, 7d (default 1d)",
    )  # fmt: skip
    usage.add_argument("--until", default="", help="and before this (same forms; default now)")
    usage.add_argument("--format", choices=FORMATS, default="table", help="output format")
    usage.add_argument(
        "--entries", action="store_true", help="one row per request instead of totals"
    )
    usage.set_defaults(handler=_usage)


def parse_time(text: str, now_s: float) -> int:
    """Unix milliseconds for an ISO time or a span ago (`90m`); ValueError otherwise."""
    ago = AGO.match(text.strip())
    if ago:
        return int((now_s - float(ago.group(1)) * UNIT_S[ago.group(2)]) * 1000)
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        message = f"--since/--until: {text!r} is neither an ISO time nor a span ago"
        raise ValueError(message) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return int(when.timestamp() * 1000)


def _usage(args: argparse.Namespace) -> int:
    now = time.time()
    since = parse_time(args.since, now)
    until = parse_time(args.until, now) if args.until else None
    entries = read(connect(args.redis_url, timeout_s=5.0), args.namespace, since, until)
    try:
        if args.entries:
            write_entries(entries, args.format, sys.stdout)
        else:
            write_totals(entries, args.format, sys.stdout)
    except redis.RedisError as exc:
        print(f"pdserve usage: the ledger's Redis: {exc}", file=sys.stderr)
        return 1
    return 0


def write_totals(entries: Iterable[UsageEntry], fmt: str, out: TextIO) -> None:
    """Totals by (tenant, model, adapter) in `fmt` (table, csv or json)."""
    rows = [
        {"tenant": t, "model": m, "adapter": a, **asdict(sums)}
        for (t, m, a), sums in totals(iter(entries)).items()
    ]
    _write(rows, list(TOTAL_COLUMNS), fmt, out)


def write_entries(entries: Iterable[UsageEntry], fmt: str, out: TextIO) -> None:
    """One row per request in `fmt`."""
    rows = [{**asdict(e), "outcome": e.outcome.value} for e in entries]
    columns = list(UsageEntry.__dataclass_fields__)
    _write(rows, columns, fmt, out)


def _write(rows: list[dict[str, object]], columns: list[str], fmt: str, out: TextIO) -> None:
    if fmt == "json":
        json.dump(rows, out, indent=1)
        out.write("\n")
    elif fmt == "csv":
        writer = csv.DictWriter(out, columns)
        writer.writeheader()
        writer.writerows(rows)
    else:
        widths = [max([len(c), *(len(str(r[c])) for r in rows)]) for c in columns]
        header: dict[str, object] = {c: c for c in columns}
        for line in [header, *rows]:
            cells = (str(line[c]).ljust(w) for c, w in zip(columns, widths, strict=True))
            out.write("  ".join(cells).rstrip() + "\n")
