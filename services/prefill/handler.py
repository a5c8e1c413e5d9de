"""The Prefill RPC: first token plus a leased KvHandle.

Lifecycle of one call: the request joins the engine with `max_tokens=1` and
`hold_kv=True` (chunked prefill and prefix-cache hits apply as usual); when its one
token is sampled, either the request is already over (the token is EOS or a stop, or
the client asked for one token) and its blocks are released at once, or the exporter
leases the held blocks and the handle goes back, with the engine-measured phases
(prefill.queue, prefill.compute), which are also recorded as spans in the caller's trace.
A cancelled call aborts the request and drops any lease.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
from opentelemetry.context import Context

from engine.request import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.exporter import KvExporter
from pdserve.v1 import common_pb2, worker_pb2
from services.common import adapter_proto, priority_proto, sampling
from services.common.engine_loop import EngineLoop
from services.common.worker_telemetry import WorkerTelemetry


class PrefillHandler:
    def __init__(
        self,
        loop: EngineLoop,
        exporter: KvExporter,
        worker_id: str,
        telemetry: WorkerTelemetry | None = None,
    ) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.exporter = exporter
        self.worker_id = worker_id
        self.telemetry = telemetry or WorkerTelemetry.disabled(worker_id)

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        params = sampling.from_proto(request.sampling)
        # One token here; min_tokens >= 1 still keeps EOS from being that token.
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        rid = request.request_id
        parent = self.telemetry.parent(context)
        queue = self.loop.open(rid)
        finished = False
        adapter = adapter_proto.from_message(request.adapter)
        try:
            if adapter is not None:  # read from disk, if it must be, off the event loop
                await asyncio.to_thread(self.engine.load_adapter, adapter)
            self.engine.add_request(
                list(request.prompt_token_ids), first_only, request_id=rid,
                cache_salt=request.cache_salt, hold_kv=True,
                priority=priority_proto.for_engine(request.priority),
                adapter=adapter,
                deadline=priority_proto.engine_deadline(context.time_remaining()),
            )  # fmt: skip
            self.loop.wake()
            out: RequestOutput = await queue.get()
            if out.error:
                raise RuntimeError(out.error)
            finished = True
            out.raise_for_deadline()  # ended by the engine, blocks freed: DEADLINE_EXCEEDED
            response = self._respond(rid, out, params)
            response.phases.extend(self._phases(request, out, parent))
            return response
        except asyncio.CancelledError:
            self.telemetry.count_cancelled()
            raise
        finally:
            self.loop.close(rid, finished=finished)
            if not finished:
                self.exporter.cancel(rid)

    def _phases(
        self, request: worker_pb2.PrefillRequest, out: RequestOutput, parent: Context | None
    ) -> list[common_pb2.PhaseTiming]:
        """prefill.queue and prefill.compute, as spans under the caller's and as timings."""
        phases = self.telemetry.engine_phases("prefill", out)
        attrs = {"pdserve.request_id": request.request_id, "pdserve.tenant": request.cache_salt,
                 "pdserve.prompt_tokens": out.num_prompt_tokens,
                 "pdserve.cached_tokens": out.num_cached_tokens}  # fmt: skip
        return self.telemetry.emit(phases, parent, attrs)

    def _respond(
        self, rid: str, out: RequestOutput, params: SamplingParams
    ) -> worker_pb2.PrefillResponse:
        response = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0] if out.new_token_ids else 0,
            cached_tokens=out.num_cached_tokens,
            worker_id=self.worker_id,
            prompt_logprobs=sampling.logprobs_to_proto(out.prompt_logprobs),
            first_logprobs=sampling.logprobs_to_proto(out.logprobs + out.fork_logprobs),
            fork_token_ids=out.fork_token_ids,
        )
        ended = out.finish_reason in (FinishReason.STOP, FinishReason.ABORT)
        # With forks the decode worker ends each one itself: the blocks always go there
        # (unless the request was aborted).
        if out.finish_reason is FinishReason.ABORT or (
            params.n == 1 and (ended or params.max_tokens == 1)
        ):
            self.engine.release_held(rid)
            response.finished = True
            response.finish_reason = sampling.finish_reason(out.finish_reason)
            return response
        response.kv_handle.CopyFrom(self.exporter.export(rid))
        return response

    def abort(self, request_id: str) -> bool:
        dropped = self.exporter.cancel(request_id)
        released = self.engine.release_held(request_id)
        self.engine.abort(request_id)
        self.loop.wake()
        return dropped or released
