"""The round's decision on the in-process cluster (real matchmaking and all-reduce over loopback gRPC,
in-memory DHT): a commit needs a quorum of the round's voters (the previous commit's contributors), counted
without those that retired.

Partitions split the DHT twin per side and fail data-plane calls across sides: of two sides at most one
commits a round, and once the partition heals every peer holds one θ_global again. Members that leave
gracefully announce it, and the rest go on without them.

The split happens when the last of the four peers applies round `SPLIT_AFTER`'s commit (all four are
then the next round's voters), so it does not depend on timing; it heals once each side has shown what it does
with the round it is stuck at (aborts, or commits on the majority side).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from swarmtrain.config import load_config
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter, HealEvent
from swarmtrain.testing.cluster import (
    TINY_RUN,
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)
from swarmtrain.testing.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROUNDS, SPLIT_AFTER = 8, 1
NAMES = "abcd"
RUN = [
    *TINY_RUN, "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
    "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=2.0", "rpc.retries=1", f"diloco.rounds={ROUNDS}",
]


async def _swarm(tmp_path: Path, sides: Sequence[str],
                 healed_when: Callable[[dict[str, EventLog]], bool]) -> dict[str, EventLog]:
    """Run four peers; split them into `sides` after round SPLIT_AFTER; heal once `healed_when(logs)`."""
    services = LoopbackServices()
    await publish_run(services.registry, RUN)
    logs = {n: EventLog() for n in NAMES}
    peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}"]), writer=EventWriter(logs[n]),
                     services=services) for n in NAMES}
    applied: set[str] = set()
    split = threading.Event()
    lock = threading.Lock()

    def split_after_all_apply(peer: Peer) -> None:
        worker, apply = peer.worker, peer.worker.apply  # type: ignore[union-attr]

        def apply_then_maybe_split(result, **kwargs):  # type: ignore[no-untyped-def]
            out = apply(result, **kwargs)
            if result.committed and result.round == SPLIT_AFTER:
                with lock:
                    applied.add(peer.discovery.peer_id)  # type: ignore[union-attr]
                    if len(applied) == len(NAMES) and not split.is_set():
                        ids = {n: p.discovery.peer_id for n, p in peers.items()}  # type: ignore[union-attr]
                        services.partition.split(*[[ids[n] for n in side] for side in sides])
                        split.set()
            return out

        worker.apply = apply_then_maybe_split  # type: ignore[method-assign,union-attr]

    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_peer(peers[n], stop, started=split_after_all_apply)) for n in NAMES]
    try:
        await asyncio.to_thread(wait_until, split.is_set, timeout_s=120, what="the split")
        try:
            await asyncio.to_thread(wait_until, lambda: healed_when(logs), timeout_s=90, what="the partition's effect")
        except TimeoutError as e:
            raise AssertionError(f"{e}: {story(logs)}") from None
        services.partition.heal()
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * len(NAMES), story(logs)
        # One machine clock: the other side's records, frozen until they expire, must not read as skew
        # (the peers would leave the partition on different clocks and miss each other's windows).
        offsets = {n: p.presence.clock_offset_s for n, p in peers.items() if p.presence is not None}
        assert len(offsets) == len(NAMES) and all(abs(x) < 0.5 for x in offsets.values()), offsets
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return logs


def _aborts(log: EventLog, round_index: int) -> int:
    return sum(1 for e in log.rounds() if e.round == round_index and not e.committed)


def test_two_equal_sides_of_a_partition_commit_nothing_and_agree_after_it_heals(tmp_path: Path) -> None:
    stuck = SPLIT_AFTER + 1

    def each_side_done_with_the_round(logs: dict[str, EventLog]) -> bool:  # aborted it twice, or (wrongly) committed
        return all(_aborts(log, stuck) >= 2 or any(e.committed and e.round == stuck for e in log.rounds())
                   for log in logs.values())

    logs = asyncio.run(_swarm(tmp_path, ["ab", "cd"], healed_when=each_side_done_with_the_round))
    told = story(logs)
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)), told
    assert all(len(h) == 1 for h in by_round.values()), f"a round committed with two θ_global: {told}"
    for n, log in logs.items():
        during = [e for e in log.rounds() if e.round == stuck and not e.committed]
        # a side holds 2 of the round's 4 voters: no quorum promises or accepts its ballot
        assert during and any("of 4 voters" in e.reason for e in during), (n, told)
        # round `stuck` committed once, after the heal, with all four
        commit = [e for e in log.rounds() if e.round == stuck and e.committed]
        assert commit and len(commit[0].members) == 4, (n, told)


def test_the_majority_side_goes_on_and_the_minority_heals_afterwards(tmp_path: Path) -> None:
    def majority_moved_on(logs: dict[str, EventLog]) -> bool:
        return all(any(e.committed and e.round >= SPLIT_AFTER + 2 for e in logs[n].rounds()) for n in "abc") \
            and _aborts(logs["d"], SPLIT_AFTER + 1) >= 2

    logs = asyncio.run(_swarm(tmp_path, ["abc", "d"], healed_when=majority_moved_on))
    told = story(logs)
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    d_rounds = logs["d"].rounds()
    assert not any(e.committed and e.round in (SPLIT_AFTER + 1, SPLIT_AFTER + 2) for e in d_rounds), told
    heals = [e for e in logs["d"].events() if isinstance(e, HealEvent)]
    assert heals and heals[0].from_round == SPLIT_AFTER + 1, told
    assert any(e.committed and len(e.members) == 4 for e in d_rounds if e.round > heals[0].to_round - 1), told


def test_members_that_leave_gracefully_are_not_needed_for_the_next_commit(tmp_path: Path) -> None:
    leave_after = 1

    async def main() -> tuple[dict[str, EventLog], list[str]]:
        services = LoopbackServices()
        await publish_run(services.registry, RUN)
        logs = {n: EventLog() for n in NAMES}
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}"]),
                         writer=EventWriter(logs[n]), services=services) for n in NAMES}
        stops = {n: asyncio.Event() for n in NAMES}
        tasks = [asyncio.create_task(run_peer(peers[n], stops[n])) for n in NAMES]
        try:
            def all_committed() -> bool:
                return all(any(e.committed and e.round == leave_after for e in logs[n].rounds()) for n in NAMES)

            await asyncio.to_thread(wait_until, all_committed, timeout_s=120, what=f"round {leave_after} committed")
            stops["a"].set()  # half of the last commit's members leave at once
            stops["b"].set()
            reasons = await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)
        finally:
            for stop in stops.values():
                stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return logs, reasons

    logs, reasons = asyncio.run(main())
    told = story(logs)
    assert reasons == ["signal", "signal", "done", "done"], told
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    for n in "cd":
        committed = [e for e in logs[n].rounds() if e.committed]
        # a leaver finishes the round it is in: a and b may still commit round leave_after + 1 with one survivor
        # while the other was late for that group; that one heals over it (one hash per round all the same)
        healed = {r for e in logs[n].events() if isinstance(e, HealEvent) for r in range(e.from_round, e.to_round)}
        assert healed <= {leave_after + 1}, told
        assert sorted({e.round for e in committed} | healed) == list(range(ROUNDS)), told
        assert all(len(e.members) == 2 for e in committed[-3:]), told
