"""A retry's reducer window closes once the members still pushing pushed: those the failed attempt's live
reducers heard from (`ReducerRegistry.open_session(key, awaited=...)`). A member that died with the reducer the
retry goes around used to hold every window of the retry open to its end."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging.reducer import ReducerRegistry
from swarmtrain.compress import get_codec
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey

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
