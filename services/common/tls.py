"""TLS and mutual TLS for every gRPC hop, from one typed config per process.

Lifecycle: a command builds a `TlsConfig` from its `--tls-*` flags (or `PDSERVE_TLS_*`
env vars) and hands it to the server it starts (`server_credentials`) and to every
channel it opens (`open_aio_channel` / `open_channel`). A process uses one certificate
for both directions, the way a service mesh does: a worker presents it when serving
Prefill/Decode/KvTransfer and when it dials another worker's KvTransfer service.

- no `tls_cert`: plaintext (the default; fine on loopback and inside a private network);
- `tls_cert` + `tls_key`: servers speak TLS; clients verify servers against `tls_ca`
  (or the system roots when it is empty);
- `tls_client_auth`: servers also demand and verify a client certificate signed by
  `tls_ca` (mutual TLS), and clients present theirs.

PEM files are read once, when credentials are built; a bad path fails at start with
the flag's name, not at the first request. NIXL's data plane (UCX) has no TLS: with TLS
on, the KV bytes themselves still move over UCX; keep workers on a private network or
use `--kv-backend tcp`, which runs over the TLS channel.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtransfer.channel import ChannelSecurity


@dataclass(frozen=True)
class TlsConfig:
    tls_cert: str = field(
        default="", metadata={"help": "PEM certificate chain this process presents (empty: no TLS)"}
    )
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str = field(
        default="",
        metadata={"help": "PEM CA bundle that peers' certificates must chain to (empty: system)"},
    )
    tls_client_auth: bool = field(
        default=False,
        metadata={"help": "mutual TLS: servers require client certificates signed by --tls-ca"},
    )
    tls_server_name: str = field(
        default="",
        metadata={"help": "name to verify in servers' certificates (empty: the dialed host)"},
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: set both or neither")
        if self.tls_client_auth and not (self.tls_cert and self.tls_ca):
            raise ValueError("tls_client_auth needs tls_cert, tls_key and tls_ca")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert)


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cfg: TlsConfig) -> grpc.ServerCredentials | None:
    """Credentials for `server.add_secure_port`; None means serve plaintext."""
    if not cfg.enabled:
        return None
    pair = (_read(cfg.tls_key) or b"", _read(cfg.tls_cert) or b"")
    return grpc.ssl_server_credentials(
        [pair],
        root_certificates=_read(cfg.tls_ca),
        require_client_auth=cfg.tls_client_auth,
    )


def channel_credentials(cfg: TlsConfig) -> grpc.ChannelCredentials | None:
    """Credentials to dial a pdserve server; None means plaintext."""
    if not cfg.enabled and not cfg.tls_ca:
        return None
    chain = _read(cfg.tls_cert) if cfg.tls_client_auth else None
    key = _read(cfg.tls_key) if cfg.tls_client_auth else None
    return grpc.ssl_channel_credentials(_read(cfg.tls_ca), key, chain)


def channel_options(cfg: TlsConfig, base: list[tuple[str, int]]) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = list(base)
    if cfg.tls_server_name:
        options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
    return options


def open_aio_channel(
    address: str, cfg: TlsConfig, base_options: list[tuple[str, int]]
) -> grpc.aio.Channel:
    creds = channel_credentials(cfg)
    options = channel_options(cfg, base_options)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


def add_port(server: grpc.aio.Server | grpc.Server, address: str, cfg: TlsConfig) -> int:
    """Bind `address` with TLS when configured; returns the bound port (0 = failed)."""
    creds = server_credentials(cfg)
    if creds is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, creds)


def channel_security(cfg: TlsConfig) -> ChannelSecurity:
    """Both ends of a worker's KV transfer service, for kvtransfer's exporter/importer."""
    return ChannelSecurity(server_credentials(cfg), channel_credentials(cfg), cfg.tls_server_name)


def server_ssl_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """The same certificate for the gateway's HTTP API (HTTPS; client certs under mTLS)."""
    if not cfg.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_ca:
        context.load_verify_locations(cfg.tls_ca)
    if cfg.tls_client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
    return context
