"""What a reducer keeps and how long its handlers wait, whatever key holders ask: at most
MAX_MEANS_PER_SESSION means cached per session (it used to compute and keep one for every contributor subset
asked for, 2^K of them), and a wait on a session that is dropped meanwhile ends at once with a refusal (it
used to wait forever)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging.reducer import MAX_MEANS_PER_SESSION, ReducerRegistry
from swarmtrain.compress import get_codec
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.node import Rejected

pytestmark = pytest.mark.unit

RUN = "run"
NUMEL = 64
NAMES = ("a", "b", "c", "d")
CODEC = get_codec("fp32")


def _key(round_index: int = 0) -> tuple[Group, SessionKey]:
    group = Group(RUN, round_index, tuple(Member(p, f"{p}:1") for p in NAMES))
    return group, SessionKey(RUN, round_index, group.group_id, 0, ("a",))  # a reduces the one shard


async def _pushed(reg: ReducerRegistry, key: SessionKey) -> dict[str, torch.Tensor]:
    deltas = {}
    for i, p in enumerate(NAMES):
        delta = torch.full((NUMEL,), float(i + 1))
        payload = CODEC.encode(delta)
        header = PushHeader(key, p, 0, NUMEL, len(payload), "fp32")
        await reg.check_push(header, peer=p)
        await reg.accept_push(header, bytearray(payload), peer=p)
        deltas[p] = delta
    return deltas


def test_a_session_caches_at_most_a_few_means_whatever_subsets_are_asked_for() -> None:
    async def main() -> None:
        reg = ReducerRegistry(peer_id="a", run_id=RUN, codec=CODEC, window_s=5.0, open_wait_s=1.0)
        group, key = _key()
        await reg.open_round(group, numel=NUMEL)
        deltas = await _pushed(reg, key)
        assert await reg.contributors(key, 0, peer="b") == NAMES
        subsets = [("a",), ("b",), ("c",), ("a", "b"), ("a", "c"), ("b", "c")]
        served = {}
        for subset in subsets[:MAX_MEANS_PER_SESSION]:
            served[subset] = CODEC.decode(await reg.mean(key, 0, subset, peer="b")).reshape(-1)
            want = torch.stack([deltas[p] for p in subset]).mean(0)
            torch.testing.assert_close(served[subset], want)
        for subset in subsets[MAX_MEANS_PER_SESSION:]:
            with pytest.raises(Rejected, match="already serves means"):
                await reg.mean(key, 0, subset, peer="b")
        again = CODEC.decode(await reg.mean(key, 0, subsets[0], peer="c")).reshape(-1)  # a cached one still is
        assert torch.equal(again, served[subsets[0]])
        with pytest.raises(Rejected, match="not a subset"):
            await reg.mean(key, 0, ("a", "a"), peer="b")

    asyncio.run(main())


def test_a_wait_on_a_session_dropped_meanwhile_ends_at_once_refused() -> None:
    async def main() -> None:
        reg = ReducerRegistry(peer_id="a", run_id=RUN, codec=CODEC, window_s=600.0, open_wait_s=1.0)
        group, key = _key(0)
        await reg.open_round(group, numel=NUMEL)
        payload = CODEC.encode(torch.ones(NUMEL))
        header = PushHeader(key, "b", 0, NUMEL, len(payload), "fp32")
        await reg.check_push(header, peer="b")
        await reg.accept_push(header, bytearray(payload), peer="b")  # one of four: the window stays open
        waiting = [asyncio.create_task(reg.contributors(key, 0, peer="c")),
                   asyncio.create_task(reg.mean(key, 0, ("b",), peer="c"))]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in waiting)
        later, _ = _key(2)
        await reg.open_round(later, numel=NUMEL)  # the member moved two rounds on: round 0 is stale, dropped
        for task in waiting:
            with pytest.raises(Rejected, match="dropped"):
                await asyncio.wait_for(task, timeout=1.0)

    asyncio.run(main())
