from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GossipRequest(_message.Message):
    __slots__ = ("run_id", "round", "peer_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    peer_id: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., peer_id: _Optional[str] = ...) -> None: ...

class GossipHeader(_message.Message):
    __slots__ = ("run_id", "round", "peer_id", "delta_codec", "weights_codec", "numel", "delta_bytes", "weights_bytes", "mac")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_CODEC_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    peer_id: str
    delta_codec: str
    weights_codec: str
    numel: int
    delta_bytes: int
    weights_bytes: int
    mac: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., peer_id: _Optional[str] = ..., delta_codec: _Optional[str] = ..., weights_codec: _Optional[str] = ..., numel: _Optional[int] = ..., delta_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class GossipChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GossipHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[GossipHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
