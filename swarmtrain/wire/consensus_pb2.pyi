from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ballot(_message.Message):
    __slots__ = ("attempt", "retry", "bump", "session", "proposer")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    BUMP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    retry: int
    bump: int
    session: str
    proposer: str
    def __init__(self, attempt: _Optional[int] = ..., retry: _Optional[int] = ..., bump: _Optional[int] = ..., session: _Optional[str] = ..., proposer: _Optional[str] = ...) -> None: ...

class VoterId(_message.Message):
    __slots__ = ("peer_id", "incarnation")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    incarnation: int
    def __init__(self, peer_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Contact(_message.Message):
    __slots__ = ("peer_id", "endpoint")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    endpoint: str
    def __init__(self, peer_id: _Optional[str] = ..., endpoint: _Optional[str] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("scope", "round", "ballot")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BALLOT_FIELD_NUMBER: _ClassVar[int]
    scope: str
    round: int
    ballot: Ballot
    def __init__(self, scope: _Optional[str] = ..., round: _Optional[int] = ..., ballot: _Optional[_Union[Ballot, _Mapping]] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("voter", "granted", "promised", "accepted", "value_json", "holds_material", "refusal", "reason", "retirement_json")
    VOTER_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    PROMISED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    HOLDS_MATERIAL_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETIREMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    voter: VoterId
    granted: bool
    promised: Ballot
    accepted: Ballot
    value_json: bytes
    holds_material: bool
    refusal: str
    reason: str
    retirement_json: bytes
    def __init__(self, voter: _Optional[_Union[VoterId, _Mapping]] = ..., granted: _Optional[bool] = ..., promised: _Optional[_Union[Ballot, _Mapping]] = ..., accepted: _Optional[_Union[Ballot, _Mapping]] = ..., value_json: _Optional[bytes] = ..., holds_material: _Optional[bool] = ..., refusal: _Optional[str] = ..., reason: _Optional[str] = ..., retirement_json: _Optional[bytes] = ...) -> None: ...

class AcceptRequest(_message.Message):
    __slots__ = ("scope", "round", "ballot", "value_json", "holders")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BALLOT_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    scope: str
    round: int
    ballot: Ballot
    value_json: bytes
    holders: _containers.RepeatedCompositeFieldContainer[Contact]
    def __init__(self, scope: _Optional[str] = ..., round: _Optional[int] = ..., ballot: _Optional[_Union[Ballot, _Mapping]] = ..., value_json: _Optional[bytes] = ..., holders: _Optional[_Iterable[_Union[Contact, _Mapping]]] = ...) -> None: ...

class AcceptReply(_message.Message):
    __slots__ = ("voter", "granted", "grant_json", "promised", "refusal", "reason", "retirement_json")
    VOTER_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    GRANT_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMISED_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETIREMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    voter: VoterId
    granted: bool
    grant_json: bytes
    promised: Ballot
    refusal: str
    reason: str
    retirement_json: bytes
    def __init__(self, voter: _Optional[_Union[VoterId, _Mapping]] = ..., granted: _Optional[bool] = ..., grant_json: _Optional[bytes] = ..., promised: _Optional[_Union[Ballot, _Mapping]] = ..., refusal: _Optional[str] = ..., reason: _Optional[str] = ..., retirement_json: _Optional[bytes] = ...) -> None: ...

class LearnRequest(_message.Message):
    __slots__ = ("scope", "round")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    scope: str
    round: int
    def __init__(self, scope: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class LearnReply(_message.Message):
    __slots__ = ("certificate_json", "voter", "has_vote", "accepted", "value_json", "grant_json", "holds_material")
    CERTIFICATE_JSON_FIELD_NUMBER: _ClassVar[int]
    VOTER_FIELD_NUMBER: _ClassVar[int]
    HAS_VOTE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    GRANT_JSON_FIELD_NUMBER: _ClassVar[int]
    HOLDS_MATERIAL_FIELD_NUMBER: _ClassVar[int]
    certificate_json: bytes
    voter: VoterId
    has_vote: bool
    accepted: Ballot
    value_json: bytes
    grant_json: bytes
    holds_material: bool
    def __init__(self, certificate_json: _Optional[bytes] = ..., voter: _Optional[_Union[VoterId, _Mapping]] = ..., has_vote: _Optional[bool] = ..., accepted: _Optional[_Union[Ballot, _Mapping]] = ..., value_json: _Optional[bytes] = ..., grant_json: _Optional[bytes] = ..., holds_material: _Optional[bool] = ...) -> None: ...

class CertificatesRequest(_message.Message):
    __slots__ = ("scope", "from_round")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    scope: str
    from_round: int
    def __init__(self, scope: _Optional[str] = ..., from_round: _Optional[int] = ...) -> None: ...

class CertificatesReply(_message.Message):
    __slots__ = ("certificate_json",)
    CERTIFICATE_JSON_FIELD_NUMBER: _ClassVar[int]
    certificate_json: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, certificate_json: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MaterialRequest(_message.Message):
    __slots__ = ("scope", "layout_json", "shard")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    scope: str
    layout_json: bytes
    shard: int
    def __init__(self, scope: _Optional[str] = ..., layout_json: _Optional[bytes] = ..., shard: _Optional[int] = ...) -> None: ...

class MaterialChunk(_message.Message):
    __slots__ = ("total_bytes", "data")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
