"""The Decode RPC: import a request's KV (decode role) or compute it here (mixed role),
then stream tokens from the continuous batch until the request finishes.

Lifecycle of one stream: open an output queue first; import the KvHandle in a worker
thread (the import commits the request into the engine's batch) or add the whole
request to the engine (mixed); yield one chunk per engine step's tokens; when the client
closes the stream the handler is cancelled and `EngineLoop.close` aborts the request,
which frees its blocks at the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.importer import KvImporter
from pdserve.v1 import common_pb2, worker_pb2
from services.common import sampling
from services.common.engine_loop import EngineLoop


class DecodeHandler:
    def __init__(self, loop: EngineLoop, importer: KvImporter | None) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.importer = importer

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeChunk]:
        params = sampling.from_proto(request.sampling)
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        queue = self.loop.open(rid)
        finished = False
        try:
            kv_bytes, queued = await self._start(request, prompt, params)
            if not queued:
                finished = True
                yield worker_pb2.DecodeChunk(
                    finished=True, finish_reason=common_pb2.FINISH_REASON_STOP
                )
                return
            first = True
            while not finished:
                out: RequestOutput = await queue.get()
                if out.error:
                    raise RuntimeError(out.error)
                finished = out.finished
                yield self._chunk(out, kv_bytes if first else 0)
                first = False
        finally:
            self.loop.close(rid, finished=finished)

    async def _start(
        self, request: worker_pb2.DecodeRequest, prompt: list[int], params: SamplingParams
    ) -> tuple[int, bool]:
        """Get the request into the batch; returns (KV bytes imported, queued?)."""
        rid = request.request_id
        if request.HasField("kv_handle"):
            if self.importer is None:
                raise ValueError("this worker has no KV importer (role prefill)")
            result = await asyncio.to_thread(
                self.importer.import_kv, request.kv_handle, prompt, params,
                request_id=rid, cache_salt=request.cache_salt,
            )  # fmt: skip
            self.loop.wake()
            return result.bytes, result.queued
        self.engine.add_request(prompt, params, request_id=rid, cache_salt=request.cache_salt)
        self.loop.wake()
        return 0, True

    @staticmethod
    def _chunk(out: RequestOutput, kv_bytes: int) -> worker_pb2.DecodeChunk:
        return worker_pb2.DecodeChunk(
            token_ids=out.new_token_ids,
            finished=out.finished,
            finish_reason=sampling.finish_reason(out.finish_reason),
            cached_tokens=out.num_cached_tokens,
            kv_bytes=kv_bytes,
        )
