"""The Decode RPC: import a request's KV (decode role) or compute it here (mixed role),
then stream tokens from the continuous batch until the request finishes.

Lifecycle of one stream: open an output queue first; import the KvHandle in a worker
thread (the import commits the request into the engine's batch) or add the whole
request to the engine (mixed); yield one chunk per engine step's tokens; when the client
closes the stream the handler is cancelled and `EngineLoop.close` aborts the request,
which frees its blocks at the next step. `DecodeTrace` records the request's phases
(kv.transfer, decode.queue, decode.first_token, decode.stream) as spans and as timings on
the first and last chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.request import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.importer import ImportResult, KvImporter
from pdserve.v1 import worker_pb2
from services.common import priority_proto, sampling
from services.common.engine_loop import EngineLoop
from services.common.worker_telemetry import WorkerTelemetry
from services.decode.decode_trace import DecodeTrace


class DecodeHandler:
    def __init__(
        self,
        loop: EngineLoop,
        importer: KvImporter | None,
        telemetry: WorkerTelemetry | None = None,
    ) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.importer = importer
        self.telemetry = telemetry or WorkerTelemetry.disabled()

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeChunk]:
        params = sampling.from_proto(request.sampling)
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        trace = DecodeTrace(self.telemetry, request, self.telemetry.parent(context))
        queue = self.loop.open(rid)
        finished = False
        try:
            deadline = priority_proto.engine_deadline(context.time_remaining())
            kv_bytes, ended = await self._start(request, prompt, params, trace, deadline)
            if ended is not None:  # the imported first token already ended it
                finished = True
                chunk = worker_pb2.DecodeChunk(
                    finished=True, finish_reason=sampling.finish_reason(ended)
                )
                chunk.phases.extend(trace.take())
                yield chunk
                return
            first = True
            while not finished:
                out: RequestOutput = await queue.get()
                if out.error:
                    raise RuntimeError(out.error)
                finished = out.finished
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

    async def _start(
        self,
        request: worker_pb2.DecodeRequest,
        prompt: list[int],
        params: SamplingParams,
        trace: DecodeTrace,
        deadline: float | None,
    ) -> tuple[int, FinishReason | None]:
        """Get the request into the batch at its class, with the caller's deadline;
        returns (KV bytes imported, None), or, when the import's first token already
        ended the request, (bytes, why)."""
        rid = request.request_id
        priority = priority_proto.for_engine(request.priority)
        if request.HasField("kv_handle"):
            if self.importer is None:
                raise ValueError("this worker has no KV importer (role prefill)")
            with trace.transfer(request.kv_handle) as span:
                importing = asyncio.ensure_future(asyncio.to_thread(
                    self.importer.import_kv, request.kv_handle, prompt, params,
                    request_id=rid, cache_salt=request.cache_salt, metadata=span.metadata,
                    priority=priority, request_deadline=deadline,
                ))  # fmt: skip
                try:
                    result = await asyncio.shield(importing)
                except asyncio.CancelledError:
                    # The stream closed mid-import. The thread cannot be stopped and may
                    # not have reserved the request yet (an abort now would find no such
                    # id and be dropped), so abort it once the import is over: a
                    # committed import would otherwise decode to max_tokens unread.
                    importing.add_done_callback(lambda done: self._abort_after(rid, done))
                    raise
                span.done(result)
            self.loop.wake()
            return result.bytes, result.finish_reason
        self.engine.add_request(
            prompt, params, request_id=rid, cache_salt=request.cache_salt,
            priority=priority, deadline=deadline,
        )  # fmt: skip
        self.loop.wake()
        return 0, None

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
        )
