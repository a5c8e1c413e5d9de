"""The importer's end of a KV lease: the Release call whose answer proves the read.

A NIXL read is one-sided: the exporter never sees it, so it cannot refuse a read of
blocks whose lease already ended (expired, or cancelled by the gateway) and that its
engine may have freed and filled with another request's KV, another tenant's included.
What the exporter can say is whether the lease was still live when the importer let it
go: leases end only through the exporter's table (release, cancel, expiry), and every
end unpins the blocks; so a lease that the Release call finds live was pinned from its
grant through the whole read. `release` returns that answer, and the importer commits
the blocks only on True (otherwise it discards them: `KvImporter.import_kv`). The same
holds for the TCP fallback, whose ReadBlocks checks the lease only when it starts.

Lifecycle: `connect(peer_key, address)` once per exporter incarnation (the importer's
handshake), `release` once per import, `forget` when the incarnation is gone, `close`
at shutdown. One gRPC channel per incarnation. Thread-safe.
"""

from __future__ import annotations

import time

import grpc

from kvtransfer.channel import PeerChannels
from kvtransfer.grpc_errors import transfer_error_from_rpc
from pdserve.v1 import common_pb2, kvtransfer_pb2

#: The least time a release is given, even past the import's deadline: the blocks are
#: read, and an unanswered release costs the import.
MIN_RELEASE_TIMEOUT_S = 0.5


class LeaseReleaser(PeerChannels):
    """The exporters' channels (`PeerChannels`), and the release over them."""

    def release(self, peer_key: str, handle: common_pb2.KvHandle, deadline: float) -> bool:
        """End the handle's lease; True when the exporter found it live (it was held for
        the whole read), False when it had already ended. PeerUnavailableError when the
        exporter does not answer (or another TransferError): then nothing is proved."""
        stub = self.stub(peer_key)
        timeout = max(deadline - time.monotonic(), MIN_RELEASE_TIMEOUT_S)
        request = kvtransfer_pb2.ReleaseRequest(lease_id=handle.lease_id)
        try:
            response = stub.Release(request, timeout=timeout)
        except grpc.RpcError as exc:
            context = f"KV lease release at {handle.transfer_address}"
            raise transfer_error_from_rpc(exc, context) from exc
        return bool(response.released)
