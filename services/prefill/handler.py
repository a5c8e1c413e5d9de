"""The Prefill RPC: first token plus a leased KvHandle.

Lifecycle of one call: the message is decoded once into the request contract
(`request_codec.spec_of`, its deadline the call's); the request joins the engine with
`max_tokens=1` and `hold_kv=True` (chunked prefill and prefix-cache hits apply as usual);
when its one token is sampled, either the request is already over (the token is EOS or a stop, or
the client asked for one token) and its blocks are released at once, or the exporter
leases the held blocks (hashing each for its checksum, in a worker thread) and the handle
goes back, with the engine-measured phases
(prefill.queue, prefill.compute), which are also recorded as spans in the caller's trace.
A cancelled call aborts the request and drops any lease.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
from opentelemetry.context import Context

from engine.finish_reason import FinishReason
from engine.request import RequestOutput
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from kvtransfer.exporter import KvExporter
from pdserve.v1 import common_pb2, worker_pb2
from services.common import request_codec, sampling
from services.common.detached import undone_if_cancelled
from services.engine_host.loop import EngineLoop
from services.engine_host.telemetry import WorkerTelemetry


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
        spec = request_codec.spec_of(request, context.time_remaining())
        params = spec.sampling
        # One token here; min_tokens >= 1 still keeps EOS from being that token.
        first_only = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        rid = spec.request_id
        parent = self.telemetry.parent(context)
        queue = self.loop.open(rid)
        finished = False
        try:
            if spec.adapter is not None:  # read from disk, if it must be, off the event loop
                await asyncio.to_thread(self.engine.load_adapter, spec.adapter)
            self.engine.add_request(replace(spec, sampling=first_only), hold_kv=True)
            self.loop.wake()
            out: RequestOutput = await queue.get()
            if out.error:
                raise RuntimeError(out.error)
            finished = True
            out.raise_for_deadline()  # ended by the engine, blocks freed: DEADLINE_EXCEEDED
            response = self._respond(rid, out, params)
            if not response.finished:
                response.kv_handle.CopyFrom(await self._export(rid))
            response.phases.extend(self._phases(spec, out, parent))
            return response
        except asyncio.CancelledError:
            self.telemetry.count_cancelled()
            raise
        finally:
            self.loop.close(rid, finished=finished)
            if not finished:
                self.exporter.cancel(rid)

    def _phases(
        self, spec: RequestSpec, out: RequestOutput, parent: Context | None
    ) -> list[common_pb2.PhaseTiming]:
        """prefill.queue and prefill.compute, as spans under the caller's and as timings."""
        phases = self.telemetry.engine_phases("prefill", out)
        attrs: dict[str, str | int] = {
            "pdserve.request_id": spec.request_id,
            "pdserve.tenant": spec.cache_salt,
            "pdserve.prompt_tokens": out.num_prompt_tokens,
            "pdserve.cached_tokens": out.num_cached_tokens,
        }
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
            self.engine.handoff.release_held(rid)
            response.finished = True
            response.finish_reason = sampling.finish_reason(out.finish_reason)
        return response

    async def _export(self, request_id: str) -> common_pb2.KvHandle:
        """The lease and handle on a held request's KV, made in a worker thread: its
        checksums read every byte of the blocks. If the call is cancelled meanwhile, the
        lease and the held blocks are given back once the thread is done."""
        return await undone_if_cancelled(
            self.exporter.export, request_id, undo=lambda done: self._unexport(request_id, done)
        )

    def _unexport(self, request_id: str, exporting: asyncio.Future[common_pb2.KvHandle]) -> None:
        if not exporting.cancelled():
            exporting.exception()  # retrieved, so asyncio does not log it as unseen
        self.exporter.cancel(request_id)
        self.engine.handoff.release_held(request_id)

    def abort(self, request_id: str) -> bool:
        dropped = self.exporter.cancel(request_id)
        released = self.engine.handoff.release_held(request_id)
        self.engine.abort(request_id)
        self.loop.wake()
        return dropped or released
