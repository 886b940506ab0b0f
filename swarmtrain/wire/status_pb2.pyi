from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PeerStatus(_message.Message):
    __slots__ = ("peer_id", "run_id", "role", "client_mode", "round", "state_hash", "tokens_per_s", "bandwidth_bytes_per_s", "last_heartbeat_unix_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_id: str
    role: str
    client_mode: bool
    round: int
    state_hash: bytes
    tokens_per_s: float
    bandwidth_bytes_per_s: float
    last_heartbeat_unix_s: float
    def __init__(self, peer_id: _Optional[str] = ..., run_id: _Optional[str] = ..., role: _Optional[str] = ..., client_mode: _Optional[bool] = ..., round: _Optional[int] = ..., state_hash: _Optional[bytes] = ..., tokens_per_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., last_heartbeat_unix_s: _Optional[float] = ...) -> None: ...
