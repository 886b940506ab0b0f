from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionKey(_message.Message):
    __slots__ = ("run_id", "round", "group_id", "attempt", "reducers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REDUCERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    group_id: str
    attempt: int
    reducers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., group_id: _Optional[str] = ..., attempt: _Optional[int] = ..., reducers: _Optional[_Iterable[str]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("session", "sender", "shard", "numel", "total_bytes", "codec")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    session: SessionKey
    sender: str
    shard: int
    numel: int
    total_bytes: int
    codec: str
    def __init__(self, session: _Optional[_Union[SessionKey, _Mapping]] = ..., sender: _Optional[str] = ..., shard: _Optional[int] = ..., numel: _Optional[int] = ..., total_bytes: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data", "mac")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    mac: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class ContributorsRequest(_message.Message):
    __slots__ = ("session", "shard")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    session: SessionKey
    shard: int
    def __init__(self, session: _Optional[_Union[SessionKey, _Mapping]] = ..., shard: _Optional[int] = ...) -> None: ...

class ContributorsReply(_message.Message):
    __slots__ = ("contributors",)
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    contributors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, contributors: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("session", "shard", "contributors")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    session: SessionKey
    shard: int
    contributors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[_Union[SessionKey, _Mapping]] = ..., shard: _Optional[int] = ..., contributors: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("total_bytes", "data", "mac")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    mac: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("token", "port", "total_bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    port: int
    total_bytes: int
    def __init__(self, token: _Optional[bytes] = ..., port: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...
