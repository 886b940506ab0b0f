"""A stand-in asked for a lost reducer's shard (averaging/standin.py) asks the lost reducer's own contribution
first and alone: when it is gone, the stand-in refuses at once instead of fetching every other contribution."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging.aggregate import Aggregation
from swarmtrain.averaging.standin import StandIns
from swarmtrain.compress import get_codec
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import SessionKey
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.errors import RpcUnavailable
from swarmtrain.rpc.node import Rejected

NUMEL = 64
IDS = ("a", "b", "c", "d")
KEY = SessionKey("run", 0, "group", 0, IDS)
GROUP = Group("run", 0, tuple(Member(p, f"10.0.0.{i}:7000") for i, p in enumerate(IDS)))


def _stand_in(lost_alive: bool) -> tuple[StandIns, list[str]]:
    codec = get_codec("int8")
    stand_in = StandIns(peer_id="d", codec=codec, aggregation=Aggregation(), buffers=BufferPool(max_bytes=1 << 20),
                        timeout_s=5.0)
    stand_in.keep_own(KEY, 2, codec.encode(torch.ones(NUMEL)))
    asked: list[str] = []

    async def fetch(member: Member, key: SessionKey, shard: int, numel: int, deadline: float) -> bytes:
        asked.append(member.peer_id)
        if member.peer_id == "c" and not lost_alive:
            raise RpcUnavailable(f"UNAVAILABLE: {member.endpoint} unreachable")
        return codec.encode(torch.full((numel,), float(IDS.index(member.peer_id))))

    stand_in.fetch_contribution = fetch
    return stand_in, asked


def test_a_lost_reducers_own_contribution_is_asked_alone_and_its_loss_refuses_at_once() -> None:
    stand_in, asked = _stand_in(lost_alive=False)
    with pytest.raises(Rejected, match="cannot reduce shard 2 again: c"):
        asyncio.run(stand_in.serve(KEY, 2, IDS, caller="a", group=GROUP, numel=NUMEL))
    assert asked == ["c"]  # nobody else was asked to upload its shard for nothing


def test_with_its_contribution_at_hand_the_shard_is_reduced_again_from_every_contributor() -> None:
    stand_in, asked = _stand_in(lost_alive=True)
    blob = asyncio.run(stand_in.serve(KEY, 2, IDS, caller="a", group=GROUP, numel=NUMEL))
    assert asked[0] == "c" and sorted(asked) == ["a", "b", "c"]  # d's own is local
    mean = get_codec("int8").decode(blob).reshape(-1)
    assert torch.allclose(mean, torch.full((NUMEL,), (0 + 1 + 2 + 1) / 4), atol=0.02)  # d's own is ones


def test_a_member_tells_the_shards_own_reducer_it_is_pushing_and_gives_its_shard_to_a_stand_in() -> None:
    """The shard's own reducer asks a member for its shard only to learn whether it is there (reducer.py's probe):
    the member is pushing it, and says so instead of sending it twice. A stand-in gets it."""
    member = StandIns(peer_id="b", codec=get_codec("fp32"), aggregation=Aggregation(),
                      buffers=BufferPool(max_bytes=1 << 20), timeout_s=5.0)
    own = get_codec("fp32").encode(torch.ones(NUMEL))
    member.keep_own(KEY, 2, own)
    with pytest.raises(Rejected, match="b is pushing shard 2 to c"):
        member.own_contribution(KEY, 2, caller="c")  # c reduces shard 2
    assert member.own_contribution(KEY, 2, caller="d") == own  # d stands in for it
