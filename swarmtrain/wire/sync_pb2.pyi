from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateRequest(_message.Message):
    __slots__ = ("run_id", "offset", "length", "header_only")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HEADER_ONLY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    offset: int
    length: int
    header_only: bool
    def __init__(self, run_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., header_only: _Optional[bool] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("run_id", "round", "config_json", "total_bytes", "sha256", "mac")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    config_json: str
    total_bytes: int
    sha256: bytes
    mac: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., config_json: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
