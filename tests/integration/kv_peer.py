"""A prefill peer process for KV-transfer tests: a real engine plus a real KvExporter.

Run as `python -m tests.integration.kv_peer --backend nixl|tcp [--port P] [--lease-ttl S]`.
It prints one JSON line `{"ready": ...}` once serving, then answers JSON commands on
stdin, one per line, until `exit` or EOF:
  {"cmd": "prefill", "prompts": [[...], ...]}  -> {"handles": [base64 KvHandle, ...]}
  {"cmd": "stats"}                     -> engine and lease counts
The control channel is test scaffolding only; handshake and block data go over the real
KvTransfer gRPC service and NIXL.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

from engine.config import DEFAULT_MODEL_CACHE, EngineConfig
from engine.engine import LLMEngine
from engine.model_store import prepare_default_model
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter


def _prefill(
    engine: LLMEngine, exporter: KvExporter, prompts: list[list[int]]
) -> dict[str, object]:
    """Prefill the prompts together (batched: a test may want hundreds), export each."""
    params = SamplingParams(max_tokens=1)
    rids = [engine.add_request(RequestSpec(p, params), hold_kv=True) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    handles = [exporter.export(rid).SerializeToString() for rid in rids]
    return {"handles": [base64.b64encode(h).decode() for h in handles]}


def _stats(engine: LLMEngine, exporter: KvExporter) -> dict[str, object]:
    s, leases = engine.stats(), exporter.stats().leases
    return {
        "used_blocks": s.used_blocks,
        "held_blocks": s.held_blocks,
        "held_requests": s.held_requests,
        "active_leases": leases.active,
        "expired": leases.expired,
        "released": leases.released,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nixl")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lease-ttl", type=float, default=30.0)
    parser.add_argument("--num-kv-blocks", type=int, default=400)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    model = prepare_default_model(DEFAULT_MODEL_CACHE.expanduser(), progress=False)
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            num_kv_blocks=args.num_kv_blocks,
            dtype="float32",
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    config = TransferConfig(
        kv_backend=args.backend, kv_lease_ttl_s=args.lease_ttl, kv_transfer_port=args.port
    )
    exporter = KvExporter(engine.handoff, config, engine_id="test-prefill").start()
    print(json.dumps({"ready": exporter.address, "incarnation": exporter.incarnation}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        reply = _prefill(engine, exporter, cmd["prompts"]) if cmd["cmd"] == "prefill" else {}
        if cmd["cmd"] == "stats":
            reply = _stats(engine, exporter)
        print(json.dumps(reply), flush=True)
    exporter.close()


if __name__ == "__main__":
    main()
