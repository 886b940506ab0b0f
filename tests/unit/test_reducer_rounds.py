"""Which group a reducer accepts pushes for while its member retries a round with a new group."""

from __future__ import annotations

import asyncio

import pytest

from swarmtrain.averaging.reducer import ReducerRegistry, max_encoded_bytes
from swarmtrain.compress import get_codec
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.node import Rejected

pytestmark = pytest.mark.unit

RUN = "run"
NUMEL = 100
MEMBERS = tuple(Member(p, f"{p}:1") for p in ("a", "b"))


def _group(attempt: int) -> Group:
    return Group(RUN, 0, MEMBERS, attempt=attempt)


def _push(group: Group, attempt: int = 0) -> PushHeader:
    """b's push of shard 0 (reduced by a) for `group`, in all-reduce attempt `attempt`."""
    key = SessionKey(RUN, 0, group.group_id, attempt, ("a", "b"))
    return PushHeader(key, "b", 0, NUMEL // 2, 0, "fp32")


def _registry() -> ReducerRegistry:
    return ReducerRegistry(peer_id="a", run_id=RUN, codec=get_codec("fp32"), window_s=5.0, open_wait_s=5.0)


async def _yield_to_others(times: int = 20) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


def test_a_push_for_the_retry_group_waits_until_the_member_opens_it() -> None:
    """The race that stalled a round for a minute: b formed round 0's second group and pushed before a,
    which aborted with the first group, had opened the second. a must wait for it, not refuse it
    against the group it abandoned; and pushes for the abandoned group are refused from then on."""

    async def main() -> None:
        reg = _registry()
        first, second = _group(0), _group(1)
        await reg.open_round(first, numel=NUMEL)
        await reg.abandon_round(first)
        early = asyncio.create_task(reg.check_push(_push(second), peer="b"))
        await _yield_to_others()
        assert not early.done(), early
        await reg.open_round(second, numel=NUMEL)
        assert await asyncio.wait_for(early, 5) == max_encoded_bytes(NUMEL // 2)
        with pytest.raises(Rejected, match="abandoned"):
            await reg.check_push(_push(first), peer="b")
        # a group its member opens again (the same members and attempt) is live again
        await reg.abandon_round(second)
        await reg.open_round(second, numel=NUMEL)
        assert await reg.check_push(_push(second, attempt=1), peer="b") == max_encoded_bytes(NUMEL // 2)

    asyncio.run(main())


def test_a_push_for_another_group_of_a_live_round_is_refused_at_once() -> None:
    """While the member is still averaging with its group, a push naming another group of the same
    round is foreign: refused immediately, naming both groups."""

    async def main() -> None:
        reg = _registry()
        ours, other = _group(0), _group(1)
        await reg.open_round(ours, numel=NUMEL)
        with pytest.raises(Rejected, match=f"group {other.group_id} is not round 0's group {ours.group_id}"):
            await asyncio.wait_for(reg.check_push(_push(other), peer="b"), 1)

    asyncio.run(main())


def test_a_push_for_a_group_never_opened_is_refused_when_the_wait_runs_out() -> None:
    async def main() -> None:
        reg = ReducerRegistry(peer_id="a", run_id=RUN, codec=get_codec("fp32"), window_s=5.0, open_wait_s=0.05)
        await reg.open_round(_group(0), numel=NUMEL)
        await reg.abandon_round(_group(0))
        with pytest.raises(Rejected, match="no session for round 0"):
            await asyncio.wait_for(reg.check_push(_push(_group(1)), peer="b"), 5)

    asyncio.run(main())
