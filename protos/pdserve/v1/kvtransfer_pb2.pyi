from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "layout_fingerprint", "importer_agent_name", "importer_agent_metadata", "layout")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    IMPORTER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    IMPORTER_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout_fingerprint: str
    importer_agent_name: str
    importer_agent_metadata: bytes
    layout: _common_pb2.KvLayout
    def __init__(self, protocol_version: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., importer_agent_name: _Optional[str] = ..., importer_agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "incarnation", "agent_name", "agent_metadata", "layout", "pool_base_address", "num_blocks", "device_id", "backends")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    incarnation: str
    agent_name: str
    agent_metadata: bytes
    layout: _common_pb2.KvLayout
    pool_base_address: int
    num_blocks: int
    device_id: int
    backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., pool_base_address: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device_id: _Optional[int] = ..., backends: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("lease_id", "block_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("data", "first_block", "num_blocks")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    first_block: int
    num_blocks: int
    def __init__(self, data: _Optional[bytes] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
