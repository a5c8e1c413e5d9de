"""gRPC channels and ports of the KV transfer service, plaintext or TLS.

Lifecycle: the worker that owns an exporter or importer builds one `ChannelSecurity`
from its TLS settings (`services.common.tls.channel_security`) and passes it in; the
exporter binds its port with `bind`, and every channel an importer opens to an exporter
(handshake, the TCP backend's reads and releases) comes from `dial`. kvtransfer itself
reads no certificate files and no config beyond this.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from kvtransfer.errors import PeerUnavailableError
from pdserve.v1 import kvtransfer_pb2_grpc

#: A block of a large model can exceed gRPC's 4 MiB default message size.
MAX_MESSAGE_BYTES = 256 << 20
MESSAGE_SIZE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
#: Peers inside a cluster restart in seconds (a crashed worker relaunched on its port).
#: gRPC's default reconnect backoff grows from 1 s to 120 s, so a channel that saw the
#: peer die could wait minutes to notice it is back; cap the wait at 1 s. Not
#: `min_reconnect_backoff_ms`: gRPC also uses it as the connect timeout, and a busy
#: peer must not fail a connection attempt after 100 ms.
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CHANNEL_OPTIONS: list[tuple[str, int]] = [*MESSAGE_SIZE_OPTIONS, *RECONNECT_OPTIONS]


@dataclass(frozen=True)
class ChannelSecurity:
    """Credentials for both ends; all None (the default) means plaintext."""

    server: grpc.ServerCredentials | None = None
    channel: grpc.ChannelCredentials | None = None
    target_name: str = ""  # name to verify in the server's certificate, if not the host


PLAINTEXT = ChannelSecurity()


def dial(address: str, security: ChannelSecurity = PLAINTEXT) -> grpc.Channel:
    """A synchronous channel to a KV exporter at `address`."""
    options: list[tuple[str, object]] = list(CHANNEL_OPTIONS)
    if security.target_name:
        options.append(("grpc.ssl_target_name_override", security.target_name))
    if security.channel is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, security.channel, options=options)


class PeerChannels:
    """One KvTransfer channel per exporter incarnation (its peer key), for an importer's
    parts that call the exporter (the TCP backend's reads, the lease release).
    Thread-safe; `connect` replaces (and closes) an earlier channel under the same key."""

    def __init__(self, security: ChannelSecurity = PLAINTEXT) -> None:
        self._security = security
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, kvtransfer_pb2_grpc.KvTransferStub]] = {}

    def connect(self, peer_key: str, address: str) -> None:
        channel = dial(address, self._security)
        with self._lock:
            old = self._channels.pop(peer_key, None)
            self._channels[peer_key] = (channel, kvtransfer_pb2_grpc.KvTransferStub(channel))
        if old is not None:
            old[0].close()

    def stub(self, peer_key: str) -> kvtransfer_pb2_grpc.KvTransferStub:
        with self._lock:
            entry = self._channels.get(peer_key)
        if entry is None:
            raise PeerUnavailableError(f"no connection to KV exporter {peer_key}")
        return entry[1]

    def forget(self, peer_key: str) -> None:
        with self._lock:
            entry = self._channels.pop(peer_key, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        with self._lock:
            keys = list(self._channels)
        for key in keys:
            self.forget(key)


def bind(server: grpc.Server, address: str, security: ChannelSecurity = PLAINTEXT) -> int:
    """Add `address` to `server`; returns the bound port (0 if it could not bind)."""
    if security.server is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, security.server)
