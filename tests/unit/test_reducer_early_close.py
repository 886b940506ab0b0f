"""When a reducer's contribution window closes before its end. A retry's window closes once the members still
pushing pushed: those the failed attempt's live reducers heard from (`ReducerRegistry.open_session(key,
awaited=...)`); a member that died with the reducer the retry goes around used to hold every window of the
retry open to its end. And once a majority pushed, a reducer asks the serving members still missing for their
shard: one that cannot be reached is not waited for (a member that crashed after its group formed used to
hold the window open to its end), a live one is."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging.reducer import ReducerRegistry
from swarmtrain.compress import get_codec
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.errors import RpcRejected, RpcUnavailable
from swarmtrain.testing.sim.loop import run_virtual

pytestmark = pytest.mark.unit

RUN = "run"
NUMEL = 64
NAMES = ("a", "b", "c", "d", "e")
CODEC = get_codec("fp32")
WINDOW_S = 600.0  # never reached here: a window that closes does so because the awaited pushed


async def _retry(awaited: frozenset[str], pushers: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
    """Open attempt 1 of a group of five on reducer a with `awaited`, push from `pushers`: whether the window
    closed, and its contributors if so."""
    reg = ReducerRegistry(peer_id="a", run_id=RUN, codec=CODEC, window_s=WINDOW_S, open_wait_s=1.0)
    group = Group(RUN, 0, tuple(Member(p, f"{p}:1") for p in NAMES))
    key = SessionKey(RUN, 0, group.group_id, 1, ("a",))
    await reg.open_round(group, numel=NUMEL)
    await reg.open_session(key, awaited=awaited)
    for p in pushers:
        payload = CODEC.encode(torch.ones(NUMEL))
        header = PushHeader(key, p, 0, NUMEL, len(payload), "fp32")
        await reg.check_push(header, peer=p)
        await reg.accept_push(header, bytearray(payload), peer=p)
    closed = asyncio.create_task(reg.contributors(key, 0, peer="b"))
    await asyncio.sleep(0.01)
    done = closed.done()
    closed.cancel()
    return done, (closed.result() if done else ())


def test_a_retry_window_closes_once_the_members_the_last_attempt_heard_from_pushed() -> None:
    done, contributors = asyncio.run(_retry(frozenset({"a", "b", "c"}), ("a", "b", "c")))
    assert done and contributors == ("a", "b", "c")  # d and e (dead with the lost reducer) not waited for


def test_without_a_hint_or_with_a_minority_one_the_window_waits_for_every_member() -> None:
    assert asyncio.run(_retry(frozenset(), ("a", "b", "c"))) == (False, ())
    # two of five heard from says more about the hint than about the group: not trusted to close early
    assert asyncio.run(_retry(frozenset({"a", "b"}), ("a", "b"))) == (False, ())


def test_a_member_outside_the_hint_may_still_push_while_the_window_is_open() -> None:
    done, contributors = asyncio.run(_retry(frozenset({"a", "b", "c", "x"}), ("d", "a", "b", "c")))
    assert done and contributors == ("a", "b", "c", "d")  # x is no member: the hint is cut to the group


def test_a_member_that_cannot_be_reached_is_not_waited_for_once_a_majority_pushed() -> None:
    """Seven members, window 4 s, virtual time: e crashed after the group formed, f is behind NAT (client mode:
    it cannot be called), d is slow. a, b, c push at once, g at 1.5 s, d at 2.5 s, f at 3 s. At 1 s three of
    seven is no majority: nobody is asked. At 2 s d and e are asked: d answers that it is pushing and is waited
    for, e cannot be reached and is not; f is never asked. The window closes when f pushes, at 3 s, not at 4 s."""
    names = ("a", "b", "c", "d", "e", "f", "g")
    members = tuple(Member(p, "" if p == "f" else f"{p}:1", client_mode=p == "f") for p in names)
    asked: list[tuple[str, float]] = []

    async def main() -> tuple[float, tuple[str, ...]]:
        loop = asyncio.get_running_loop()
        reg = ReducerRegistry(peer_id="a", run_id=RUN, codec=CODEC, window_s=4.0, open_wait_s=1.0)

        async def fetch(member: Member, key: SessionKey, shard: int, numel: int, deadline: float) -> bytes:
            asked.append((member.peer_id, loop.time()))
            if member.peer_id == "e":
                raise RpcUnavailable("UNAVAILABLE: e:1 unreachable")
            raise RpcRejected("FAILED_PRECONDITION", f"{member.peer_id} is pushing shard 0 to a")

        reg.standins.fetch_contribution = fetch
        group = Group(RUN, 0, members)
        key = SessionKey(RUN, 0, group.group_id, 0, ("a",))
        await reg.open_round(group, numel=NUMEL)
        await reg.open_session(key)

        async def push(p: str, at: float) -> None:
            await asyncio.sleep(at - loop.time())
            payload = CODEC.encode(torch.ones(NUMEL))
            header = PushHeader(key, p, 0, NUMEL, len(payload), "fp32")
            await reg.check_push(header, peer=p)
            await reg.accept_push(header, bytearray(payload), peer=p)

        await asyncio.gather(*(push(p, 0.0) for p in "abc"), push("g", 1.5), push("d", 2.5), push("f", 3.0))
        contributors = await reg.contributors(key, 0, peer="b")
        return loop.time(), contributors

    closed_at, contributors = run_virtual(main)
    assert contributors == ("a", "b", "c", "d", "f", "g")
    assert closed_at == pytest.approx(3.0)
    assert [p for p, _ in asked] == ["d", "e"] and all(t == pytest.approx(2.0) for _, t in asked), asked
