"""The raw chunk framing is byte-compatible with the protobuf runtime, both ways, and refuses garbage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.rpc import frames
from swarmtrain.wire import averaging_pb2 as pb

pytestmark = pytest.mark.unit


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 2**62))
def test_fetch_chunk_matches_protobuf(data: bytes, total: int) -> None:
    ours = frames.frame(frames.encode_varint_field(1, total), 2, memoryview(data))
    assert pb.FetchChunk.FromString(ours) == pb.FetchChunk(total_bytes=total, data=data)
    theirs = pb.FetchChunk(total_bytes=total, data=data).SerializeToString()
    parsed = dict(frames.fields(theirs))
    assert parsed.get(1, 0) == total and bytes(parsed.get(2, b"")) == data


def test_push_chunk_with_header_matches_protobuf() -> None:
    header = pb.PushHeader(session=pb.SessionKey(run_id="r", round=3, group_id="g", attempt=1, reducers=["a", "b"]),
                           sender="a", shard=1, numel=10, total_bytes=52, codec="fp32")
    raw_header = header.SerializeToString()
    ours = frames.frame(frames.encode_bytes_field(1, len(raw_header)) + raw_header, 2, b"\x00\x01\x02")
    assert ours == pb.PushChunk(header=header, data=b"\x00\x01\x02").SerializeToString()


@pytest.mark.parametrize("garbage", [b"\x12\x05ab", b"\x12", b"\x0d\x00\x00\x00\x00", b"\x08" + b"\xff" * 11])
def test_malformed_chunks_raise_frame_error(garbage: bytes) -> None:
    with pytest.raises(frames.FrameError):
        list(frames.fields(garbage))
