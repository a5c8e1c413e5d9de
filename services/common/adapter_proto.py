"""The LoRA adapter a request runs with, between its protobuf form and the engine's.

An unset `adapter` field (or one with an empty name) means the base model.
"""

from __future__ import annotations

from engine.lora import AdapterRef
from pdserve.v1 import common_pb2


def from_message(message: common_pb2.Adapter) -> AdapterRef | None:
    """The adapter `message` names (None: the base model)."""
    return AdapterRef(message.name, message.digest) if message.name else None


def to_proto(adapter: AdapterRef) -> common_pb2.Adapter:
    return common_pb2.Adapter(name=adapter.name, digest=adapter.digest)
