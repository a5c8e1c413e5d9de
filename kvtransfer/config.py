"""The KV-transfer config: backend, lease and deadline lengths, address, checksums."""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("nixl", "tcp")


@dataclass(frozen=True)
class TransferConfig:
    """Settings shared by the exporter (prefill) and importer (decode) sides."""

    kv_backend: str = field(default="nixl", metadata={"help": "KV transfer backend: nixl or tcp"})
    kv_lease_ttl_s: float = field(
        default=30.0, metadata={"help": "seconds exported KV stays pinned without a release"}
    )
    kv_transfer_timeout_s: float = field(
        default=10.0, metadata={"help": "deadline of one KV import (handshake + read)"}
    )
    kv_transfer_host: str = field(
        default="127.0.0.1", metadata={"help": "address the KvTransfer service binds"}
    )
    kv_transfer_port: int = field(
        default=0, metadata={"help": "port of the KvTransfer service (0 = any free port)"}
    )
    kv_checksum: bool = field(
        default=True,
        metadata={
            "help": "checksum every exported KV block and verify it on import (a mismatch "
            "is re-read once, then the prompt is computed again)"
        },
    )

    def __post_init__(self) -> None:
        if self.kv_backend not in BACKENDS:
            raise ValueError(f"kv_backend must be one of {BACKENDS}, got {self.kv_backend!r}")
        if self.kv_lease_ttl_s <= 0 or self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_lease_ttl_s and kv_transfer_timeout_s must be > 0")
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be in [0, 65536), got {self.kv_transfer_port}")
