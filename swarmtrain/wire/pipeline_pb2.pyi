from swarmtrain.wire import averaging_pb2 as _averaging_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageCall(_message.Message):
    __slots__ = ("stage", "microbatch", "shape", "tensor", "seed", "samples", "bulk")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    stage: int
    microbatch: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    tensor: bytes
    seed: int
    samples: int
    bulk: bool
    def __init__(self, stage: _Optional[int] = ..., microbatch: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., tensor: _Optional[bytes] = ..., seed: _Optional[int] = ..., samples: _Optional[int] = ..., bulk: _Optional[bool] = ...) -> None: ...

class StageUpload(_message.Message):
    __slots__ = ("stage", "microbatch", "method", "total_bytes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    microbatch: str
    method: str
    total_bytes: int
    def __init__(self, stage: _Optional[int] = ..., microbatch: _Optional[str] = ..., method: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("shape", "tensor", "queue", "step", "ticket")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    tensor: bytes
    queue: int
    step: int
    ticket: _averaging_pb2.BulkTicket
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., tensor: _Optional[bytes] = ..., queue: _Optional[int] = ..., step: _Optional[int] = ..., ticket: _Optional[_Union[_averaging_pb2.BulkTicket, _Mapping]] = ...) -> None: ...
