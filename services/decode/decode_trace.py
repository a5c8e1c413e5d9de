"""The phases of one Decode stream, as spans in the caller's trace and as chunk timings.

Lifecycle: `DecodeHandler.decode` makes one `DecodeTrace` per stream with the caller's
trace context. If the request comes with a KvHandle, `transfer()` wraps the import: a
live `kv.transfer` span whose context rides in the metadata of the importer's calls to
the prefill worker (its handshake), closed with the bytes, blocks, backend and GB/s of
the read (or the error status). Then `on_output` is told of every engine output: the
first one yields `decode.queue` and `decode.first_token` from the engine's timestamps
(plus the pending kv.transfer timing), the last one `decode.stream` (first token to
finish, with the output token count and finish reason). The timings ride on the chunk
that ends each phase, so the gateway can show the whole timeline.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterator

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from engine.request import RequestOutput
from engine.request_spec import RequestSpec
from kvtransfer.errors import KvCorruptionError
from kvtransfer.importer import ImportResult
from pdserve.v1 import common_pb2, worker_pb2
from services.common.status import status_for
from services.common.tracing import Attributes, Metadata, Phase, Tracing, epoch_ns
from services.engine_host.telemetry import WorkerTelemetry


class ChecksumOutcome(enum.StrEnum):
    """How an import whose blocks failed their checksum ended (a metric label)."""

    REPAIRED = "repaired"  # the re-read matched; the request decoded from it
    LOST = "lost"  # it failed again; the gateway has the prompt computed here instead


class TransferSpan:
    """What the import call needs (`metadata`) and reports back (`done`)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.result: ImportResult | None = None

    def done(self, result: ImportResult) -> None:
        self.result = result


class DecodeTrace:
    def __init__(
        self,
        telemetry: WorkerTelemetry,
        spec: RequestSpec,
        parent: Context | None,
    ) -> None:
        self._tel = telemetry
        self._parent = parent
        self._attrs: Attributes = {
            "pdserve.request_id": spec.request_id,
            "pdserve.tenant": spec.cache_salt,
            "pdserve.prompt_tokens": spec.num_prompt_tokens,
        }
        self._pending: list[common_pb2.PhaseTiming] = []
        self._stream_start: float | None = None

    @contextlib.contextmanager
    def transfer(self, handle: common_pb2.KvHandle) -> Iterator[TransferSpan]:
        tracing = self._tel.tracing
        start = time.monotonic()
        span: Span | None = None
        if tracing.enabled:
            attrs = {
                **self._attrs,
                "pdserve.worker_id": self._tel.worker_id,
                "kv.backend": handle.backend,
                "kv.source": handle.engine_id,
            }
            span = tracing.start(
                "kv.transfer", self._parent, attrs, kind=SpanKind.CLIENT, start_ns=epoch_ns(start)
            )
        transfer = TransferSpan(tracing.metadata(span))
        try:
            yield transfer
        except Exception as exc:
            if isinstance(exc, KvCorruptionError):
                self._count_checksum_failure(ChecksumOutcome.LOST)
            if span is not None:
                code, message = status_for(exc)
                Tracing.fail(span, code.name, message)
            raise
        finally:
            end = time.monotonic()
            self._finish_transfer(span, transfer.result, start, end)

    def _count_checksum_failure(self, outcome: ChecksumOutcome) -> None:
        if self._tel.metrics is not None:
            self._tel.metrics.checksum_failures.labels(outcome).inc()

    def _finish_transfer(
        self, span: Span | None, result: ImportResult | None, start: float, end: float
    ) -> None:
        timing = Phase("kv.transfer", start, end).timing(self._tel.worker_id)
        self._pending.append(timing)
        metrics = self._tel.metrics
        if result is not None and result.checksum_mismatches:
            self._count_checksum_failure(ChecksumOutcome.REPAIRED)
        if result is not None and metrics is not None:
            metrics.transfer_bytes.inc(result.bytes)
            metrics.transfer_blocks.inc(result.num_read_blocks)
            metrics.transfer_seconds.observe(result.seconds)
        if span is None:
            return
        if result is not None:
            span.set_attributes(
                {
                    "kv.bytes": result.bytes,
                    "kv.blocks": result.num_read_blocks,
                    "kv.cached_blocks": result.num_cached_blocks,
                    "kv.descriptors": result.descriptors,
                    "kv.gbps": round(result.gbps, 3),
                    "kv.checksum_mismatches": result.checksum_mismatches,
                    "kv.verify_ms": round(result.verify_seconds * 1000, 3),
                }
            )
        span.end(end_time=timing.end_unix_nano)

    def take(self) -> list[common_pb2.PhaseTiming]:
        """Timings not yet sent (a stream that ends without decoding)."""
        pending, self._pending = self._pending, []
        return pending

    def on_output(self, out: RequestOutput, first: bool, chunk: worker_pb2.DecodeChunk) -> None:
        """Attach the phases this output ends to its chunk (and record their spans)."""
        if first:
            phases = self._tel.engine_phases("decode", out)
            attrs = {**self._attrs, "pdserve.cached_tokens": out.num_cached_tokens}
            chunk.phases.extend(self.take())
            chunk.phases.extend(self._tel.emit(phases, self._parent, attrs))
            self._stream_start = out.first_token_time
        if out.finished and self._stream_start is not None:
            stream = Phase("decode.stream", self._stream_start, time.monotonic())
            attrs = {
                **self._attrs,
                "pdserve.output_tokens": out.num_output_tokens,
                "pdserve.finish_reason": out.finish_reason.value if out.finish_reason else "",
            }
            if out.spec_drafted:  # speculative decoding verified drafts for it
                attrs["pdserve.spec.drafted_tokens"] = out.spec_drafted
                attrs["pdserve.spec.accepted_tokens"] = out.spec_accepted
            chunk.phases.extend(self._tel.emit([stream], self._parent, attrs))
