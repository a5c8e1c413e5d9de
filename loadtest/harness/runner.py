"""Sending one run point's requests to the gateway and timing every streamed token.

Lifecycle: `run_point(address, requests, pace)` opens one `GatewayClient`, issues the
requests (Poisson arrivals at `pace.rate`, the trace's own timestamps, or a closed loop
of `pace.concurrency` users), stops issuing once `pace.duration_s` has passed, waits for
what is in flight (each stream has the client deadline `pace.request_timeout_s`, so the
wait is bounded) and returns one `RequestRecord` per request sent, in send order. A
progress bar counts finished requests. Cancelling the run cancels every open stream,
which the gateway propagates to the workers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from loadtest.harness.metrics import RequestRecord
from loadtest.harness.request_spec import BenchRequest
from services.gateway.client import GatewayClient

ARRIVALS = ("poisson", "closed")


@dataclass(frozen=True)
class Pace:
    arrival: str  # poisson or closed
    rate: float = 0.0  # requests/s (poisson)
    concurrency: int = 0  # users (closed)
    duration_s: float = 60.0  # stop issuing after this
    request_timeout_s: float = 300.0  # client deadline of one stream
    seed: int = 0  # of the Poisson gaps
    ignore_eos: bool = True
    progress: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "poisson" and self.rate <= 0:
            raise ValueError(f"rate must be > 0 for poisson arrivals, got {self.rate}")
        if self.arrival == "closed" and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 for a closed loop, got {self.concurrency}")
        if self.duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("duration_s and request_timeout_s must be > 0")


def arrival_offsets(requests: Sequence[BenchRequest], rate: float, seed: int) -> list[float]:
    """Send times from the run start: the trace's when every request has one, else a
    Poisson process (exponential gaps of mean 1/rate; the first request at 0)."""
    if requests and all(r.at_s is not None for r in requests):
        return [float(r.at_s or 0.0) for r in requests]
    rng = random.Random(f"poisson/{seed}")
    offsets, t = [], 0.0
    for i in range(len(requests)):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


class _Run:
    """Shared state of one point: the clock, the client and the finished records."""

    def __init__(self, client: GatewayClient, pace: Pace, total: int) -> None:
        self.client = client
        self.pace = pace
        self.t0 = time.perf_counter()
        self.tag = f"bench{int(time.time() * 1000) % 10**9}"  # unique ids across runs
        self.records: list[RequestRecord] = []
        self.bar = tqdm(
            total=total,
            desc=pace.label or "bench",
            unit="req",
            leave=False,
            disable=not pace.progress,
            dynamic_ncols=True,
        )
        self.errors = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def expired(self) -> bool:
        return self.now() >= self.pace.duration_s

    async def send(self, req: BenchRequest) -> None:
        rec = RequestRecord(request_id=req.request_id, kind=req.kind, sent_s=self.now())
        self.records.append(rec)  # in send order; filled in as the stream runs
        call = self.client.generate(
            req.to_proto(ignore_eos=self.pace.ignore_eos, run_tag=self.tag),
            timeout=self.pace.request_timeout_s,
        )
        last = 0.0
        try:
            async for msg in call:
                now = self.now()
                if msg.token_ids:
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    else:
                        rec.token_gaps_s.append(now - last)
                    last = now
                rec.prefill_worker = rec.prefill_worker or msg.prefill_worker
                rec.decode_worker = rec.decode_worker or msg.decode_worker
                if msg.finished:
                    rec.prompt_tokens = msg.usage.prompt_tokens
                    rec.cached_tokens = msg.usage.cached_tokens
                    rec.output_tokens = msg.usage.completion_tokens
        except grpc.aio.AioRpcError as exc:
            rec.code, rec.error = exc.code().name, exc.details() or ""
            self.errors += 1
        except asyncio.CancelledError:  # the bench itself is stopping
            rec.code = grpc.StatusCode.CANCELLED.name
            call.cancel()
            raise
        finally:
            rec.finished_s = self.now()
            self.bar.update(1)
            self.bar.set_postfix(errors=self.errors, refresh=False)


async def _open_loop(run: _Run, requests: Sequence[BenchRequest]) -> None:
    offsets = arrival_offsets(requests, run.pace.rate, run.pace.seed)
    tasks: list[asyncio.Task[None]] = []
    try:
        for req, at in zip(requests, offsets, strict=True):
            if at >= run.pace.duration_s:
                break
            delay = at - run.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run.send(req)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _closed_loop(run: _Run, requests: Sequence[BenchRequest]) -> None:
    queue: Iterator[BenchRequest] = iter(requests)

    async def user() -> None:
        for req in queue:  # a shared iterator: each request goes to exactly one user
            if run.expired():
                return
            await run.send(req)

    users = [asyncio.create_task(user()) for _ in range(run.pace.concurrency)]
    try:
        await asyncio.gather(*users)
    finally:
        for task in users:
            task.cancel()


async def run_point(
    address: str, requests: Sequence[BenchRequest], pace: Pace
) -> list[RequestRecord]:
    """Run one point; returns the records of the requests sent, in send order."""
    async with GatewayClient(address) as client:
        run = _Run(client, pace, len(requests))
        try:
            if pace.arrival == "closed":
                await _closed_loop(run, requests)
            else:
                await _open_loop(run, requests)
        finally:
            run.bar.close()
    return run.records
