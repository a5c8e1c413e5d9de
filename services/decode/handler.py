"""The Decode RPC: import a request's KV (decode role) or compute it here (mixed role),
then stream tokens from the continuous batch until the request finishes.

Lifecycle of one stream: decode the message once into the request contract
(`request_codec.spec_of`, its deadline the call's); open an output queue; import the
KvHandle in a worker thread (the import commits the request into the engine's batch) or
add the whole request to the engine (mixed role, or a decode worker prefilling locally);
a migrated stream, with or without a handle, resumes after `resume_token_ids` (with one,
the prompt's KV is imported and only the tokens so far are computed); yield one chunk per
engine step's tokens; when the client closes the stream the handler is cancelled and
`EngineLoop.close` aborts the request, which frees its blocks at the next step.
`DecodeTrace` records the request's phases (kv.transfer, decode.queue,
decode.first_token, decode.stream) as spans and as timings on the first and last chunks.

An import that finds the KV pool full waits for room (`ImportRoom`: woken when a stream
here finishes, bounded by the request's deadline and the KV lease), trying again each
time, and then fails with DecodeFullError (RESOURCE_EXHAUSTED) so that the gateway can
place the decode side elsewhere. The kv.transfer phase includes that wait. An exporter
that cannot be reached (it died or restarted) fails the import with NOT_FOUND, as a lease
that ended does: this worker is fine, the KV is what is lost, and the gateway has this
worker compute it instead of marking it down. A start that
failed leaves nothing in the engine, so its stream's end sends no abort: the gateway may
retry the same request id here at once, and a late abort would hit the retry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import grpc

from engine.finish_reason import FinishReason
from engine.request import RequestOutput
from engine.request_spec import RequestSpec
from kvtransfer.errors import LeaseExpiredError, NoBlocksError, PeerUnavailableError
from kvtransfer.importer import ImportResult, KvImporter
from pdserve.v1 import common_pb2, worker_pb2
from services.common import request_codec, sampling
from services.common.detached import undone_if_cancelled
from services.common.status import DecodeFullError
from services.decode.decode_trace import DecodeTrace, TransferSpan
from services.decode.import_room import ImportRoom
from services.engine_host.loop import EngineLoop
from services.engine_host.telemetry import WorkerTelemetry


@dataclass(frozen=True)
class Import:
    """One stream's import: its request, the handle on its KV, and the kv.transfer span."""

    spec: RequestSpec
    handle: common_pb2.KvHandle
    span: TransferSpan


class DecodeHandler:
    def __init__(
        self,
        loop: EngineLoop,
        importer: KvImporter | None,
        telemetry: WorkerTelemetry | None = None,
        room: ImportRoom | None = None,
    ) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.importer = importer
        self.telemetry = telemetry or WorkerTelemetry.disabled()
        self.room = room or ImportRoom()

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeChunk]:
        spec = request_codec.spec_of(request, context.time_remaining())
        rid = spec.request_id
        handle = request.kv_handle if request.HasField("kv_handle") else None
        trace = DecodeTrace(self.telemetry, spec, self.telemetry.parent(context))
        queue = self.loop.open(rid)
        finished = False  # the engine holds nothing of the request: nothing to abort
        try:
            try:
                kv_bytes, ended = await self._start(spec, handle, trace)
            except Exception:
                # A failed start leaves nothing in the engine (the importer cancels its
                # reservation), so no abort, which could hit a retry of this id here.
                finished = rid not in self.engine.requests
                raise
            open_forks = spec.sampling.n  # the stream ends once every fork has
            if ended is not None:  # the imported first token already ended fork 0
                open_forks -= 1
                finished = open_forks == 0
                chunk = worker_pb2.DecodeChunk(
                    finished=True, finish_reason=sampling.finish_reason(ended)
                )
                chunk.phases.extend(trace.take())
                yield chunk
            first = True
            while not finished:
                out: RequestOutput = await queue.get()
                if out.error:
                    raise RuntimeError(out.error)
                open_forks -= out.finished
                finished = open_forks == 0
                out.raise_for_deadline()  # ended by the engine, blocks freed: DEADLINE_EXCEEDED
                chunk = self._chunk(out, kv_bytes if first else 0)
                trace.on_output(out, first, chunk)
                yield chunk
                first = False
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # the caller may close the stream after the last chunk
                self.telemetry.count_cancelled()
            raise
        finally:
            self.loop.close(rid, finished=finished)
            if finished:
                self.room.freed()

    async def _start(
        self, spec: RequestSpec, handle: common_pb2.KvHandle | None, trace: DecodeTrace
    ) -> tuple[int, FinishReason | None]:
        """Get the request into the batch at its class, with the caller's deadline;
        returns (KV bytes imported, None), or, when the import's first token already
        ended the request, (bytes, why)."""
        if handle is not None:
            if self.importer is None:
                raise ValueError("this worker imports no KV (its role is not decode)")
            with trace.transfer(handle) as span:
                result = await self._import_waiting(Import(spec, handle, span))
                span.done(result)
            self.loop.wake()
            return result.bytes, result.finish_reason
        if spec.adapter is not None:  # read from disk, if it must be, off the event loop
            await asyncio.to_thread(self.engine.load_adapter, spec.adapter)
        self.engine.add_request(spec)
        self.loop.wake()
        return 0, None

    async def _import_waiting(self, job: Import) -> ImportResult:
        """Import the KV, waiting for room while the pool is full (`ImportRoom`); raises
        DecodeFullError once the wait is over. Nothing is held between tries."""
        start = time.monotonic()
        until = self.room.until(job.handle, job.spec.deadline)
        while True:
            ticket = self.room.ticket()  # before the try: a stream finishing during it counts
            try:
                return await self._import(job)
            except PeerUnavailableError as exc:
                # The exporter is gone, not this worker: the KV is lost (NOT_FOUND), so
                # the gateway has this worker compute it rather than count it down.
                raise LeaseExpiredError(f"the KV's exporter cannot be reached: {exc}") from exc
            except NoBlocksError as exc:
                if not await self.room.wait(ticket, until):
                    waited = time.monotonic() - start
                    raise DecodeFullError(
                        f"no room for the KV: {exc}; waited {waited:.1f}s for blocks to free"
                    ) from exc

    async def _import(self, job: Import) -> ImportResult:
        """One try at the import, in a worker thread."""
        assert self.importer is not None
        # If the stream closes mid-import, the thread may not have reserved the request
        # yet (an abort now would find no such id and be dropped), so it is aborted once
        # the import is over: a committed import would otherwise decode to max_tokens
        # unread.
        rid = job.spec.request_id
        import_kv = partial(self.importer.import_kv, metadata=job.span.metadata)
        return await undone_if_cancelled(
            import_kv, job.handle, job.spec, undo=lambda done: self._abort_after(rid, done)
        )

    def _abort_after(self, request_id: str, importing: asyncio.Future[ImportResult]) -> None:
        if not importing.cancelled():
            importing.exception()  # retrieved: a failed import has already cleaned up
        self.engine.abort(request_id)  # a no-op for an id the engine no longer holds
        self.loop.wake()

    @staticmethod
    def _chunk(out: RequestOutput, kv_bytes: int) -> worker_pb2.DecodeChunk:
        return worker_pb2.DecodeChunk(
            token_ids=out.new_token_ids,
            finished=out.finished,
            finish_reason=sampling.finish_reason(out.finish_reason),
            cached_tokens=out.num_cached_tokens,
            kv_bytes=kv_bytes,
            index=out.index,
            logprobs=sampling.logprobs_to_proto(out.logprobs),
            prompt_logprobs=sampling.logprobs_to_proto(out.prompt_logprobs),
        )
