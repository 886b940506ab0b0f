"""A peer whose own round fails (a NaN Δ, an error in its side of the all-reduce) aborts that round,
resynchronises and commits later with the swarm's hash; it never exits and never poisons θ_global. A peer that
sees no one says so; one whose clock is off the swarm's says so and announces the offset.

Real Peers on the in-process cluster (peer_harness.py); the faults are put on the peer from outside.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from peer_harness import RUN, live_records, peer_config, peers_of, until

from swarmtrain.averaging.transport import Fetched, Payload, ReduceTransport
from swarmtrain.diloco.worker import InnerStats
from swarmtrain.discovery import InMemoryDiscovery, PeerRecord
from swarmtrain.roles import Peer
from swarmtrain.round.group import Member
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.telemetry import EventWriter
from swarmtrain.testing.cluster import (
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUNDS, BAD_ROUND = 5, 1
ALONE_S = 1.0


def _poison_once(peer: Peer) -> None:
    """The first time the peer trains round BAD_ROUND, its weights turn NaN (a diverged step)."""
    assert peer.worker is not None
    worker, train = peer.worker, peer.worker.train_inner
    done = False

    def poisoned(*args: object, **kwargs: object) -> InnerStats:
        nonlocal done
        stats = train(*args, **kwargs)  # type: ignore[arg-type]
        if worker.round == BAD_ROUND and not done:
            done = True
            with torch.no_grad():
                worker.params[0].view(-1)[0] = float("nan")
        return stats

    worker.train_inner = poisoned  # type: ignore[method-assign]


class _ExplodingPush:
    """The peer's all-reduce transport, whose first push of round BAD_ROUND raises as a codec or a bug in the
    peer's own code would (not a network fault: the all-reduce surfaces it)."""

    def __init__(self, inner: ReduceTransport) -> None:
        self.inner = inner
        self.exploded = False

    async def push(self, reducer: Member, header: PushHeader, payload: Payload, *, deadline: float) -> None:
        if header.session.round == BAD_ROUND and not self.exploded:
            self.exploded = True
            raise RuntimeError("codec exploded")
        await self.inner.push(reducer, header, payload, deadline=deadline)

    async def contributors(self, reducer: Member, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        return await self.inner.contributors(reducer, key, shard, deadline=deadline)

    async def fetch(self, reducer: Member, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> Fetched:
        return await self.inner.fetch(reducer, key, shard, contributors, max_bytes=max_bytes, deadline=deadline)


def _fail_average_once(peer: Peer) -> None:
    assert peer.plane is not None
    allreduce = peer.plane.averager.allreduce
    allreduce.transport = _ExplodingPush(allreduce.transport)


async def _run_started(peer: Peer, stop: asyncio.Event) -> str:
    reason = "error"
    try:
        reason = await peer.run(stop)
    finally:
        await peer.aclose(reason)
    return reason


async def _run_three(run: Sequence[str], fault: Callable[[Peer], None]) -> dict[str, EventLog]:
    """a, b and c run ROUNDS rounds; `fault` is put on c once it started. All three start (their records are live)
    before any trains: round 0's group holds the three, and c's rounds are the swarm's from the first on."""
    services = LoopbackServices()
    await publish_run(services.registry, [*run, f"diloco.rounds={ROUNDS}"])
    logs = {n: EventLog() for n in "abc"}
    stop = asyncio.Event()
    peers = peers_of(services, logs)
    tasks: list[asyncio.Task[str]] = []
    try:
        for peer in peers.values():
            await peer.start()
        fault(peers["c"])
        tasks = [asyncio.create_task(_run_started(peer, stop)) for peer in peers.values()]
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=100) == ["done"] * 3, story(logs)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for peer in peers.values():
            if peer.phase != "stopped":  # a start failed, or it never ran: closed here
                await peer.aclose("error")
    return logs


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlapped"])
def test_a_nan_delta_aborts_that_peers_round_and_it_commits_later(overlap: bool) -> None:
    logs = asyncio.run(_run_three([*RUN, f"diloco.overlap={'true' if overlap else 'false'}"], _poison_once))
    told = story(logs)
    bad = [e for e in logs["c"].rounds() if not e.committed and e.reason.startswith("non-finite pseudo-gradient")]
    # overlapped, the steps trained while round BAD_ROUND averages are the next round's: its Δ is the bad one
    assert len(bad) == 1 and bad[0].round == BAD_ROUND + overlap and bad[0].members == (), told
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    assert all(len(e.members) >= 2 for log in logs.values() for e in log.rounds() if e.committed), told
    # It trains the round again from θ_global and commits it (or a later one) with the swarm's hash.
    after = logs["c"].rounds()[logs["c"].rounds().index(bad[0]) + 1:]
    assert any(e.committed and e.round >= bad[0].round for e in after), f"c never committed again: {told}"


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlapped"])
def test_an_error_in_a_peers_own_all_reduce_aborts_its_round_and_it_goes_on(overlap: bool) -> None:
    logs = asyncio.run(_run_three([*RUN, f"diloco.overlap={'true' if overlap else 'false'}"],
                                  _fail_average_once))
    told = story(logs)
    failed = [e for e in logs["c"].rounds()
              if "local error in the all-reduce: RuntimeError: codec exploded" in e.reason]
    assert len(failed) == 1 and failed[0].round == BAD_ROUND and not failed[0].committed, told
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    after = logs["c"].rounds()[logs["c"].rounds().index(failed[0]) + 1:]
    assert any(e.committed and e.round >= BAD_ROUND for e in after), f"c never committed again: {told}"


def test_a_peer_whose_own_round_aborted_stays_in_the_swarms_live_peers() -> None:
    """c's Δ of round BAD_ROUND is NaN; it resynchronises and trains the round again, slowly (4 heartbeats):
    meanwhile its heartbeats go on, and the others must still read its record."""
    retry_s = 0.8

    def poison_then_slow(peer: Peer) -> None:
        _poison_once(peer)
        assert peer.worker is not None
        worker, train = peer.worker, peer.worker.train_inner
        slowed = False

        def slow_retry(*args: object, **kwargs: object) -> InnerStats:
            nonlocal slowed
            if worker.round == BAD_ROUND and any(not e.committed for e in logs["c"].rounds()) and not slowed:
                slowed = True
                time.sleep(retry_s)
            return train(*args, **kwargs)  # type: ignore[arg-type]

        worker.train_inner = slow_retry  # type: ignore[method-assign]

    logs = {n: EventLog() for n in "ac"}

    async def main() -> list[bool]:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, [*RUN, f"diloco.rounds={ROUNDS}"])
        peers = peers_of(services, logs)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_peer(peers[n], stop, started=poison_then_slow if n == "c" else None))
                 for n in "ac"]
        seen: list[bool] = []  # whether c's record was among the live peers, at each read while it retried
        try:
            await until(lambda: any(not e.committed for e in logs["c"].rounds()), timeout_s=60,
                        what="c's aborted round", tasks=tasks, logs=logs)
            lines = len(logs["c"].rounds())
            c_id = peers["c"]._peer_id
            while len(logs["c"].rounds()) == lines:
                seen.append(any(r.peer_id == c_id for r in await live_records(services.registry, cfg.train.run_id)))
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return seen

    seen = asyncio.run(main())
    assert len(seen) >= 8 and all(seen), (seen, story(logs))


def test_a_peer_that_sees_no_one_says_so_once_and_in_its_round_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Alone past discovery.alone_warning_s: one warning and alone_s > 0 in round lines; a second peer
    arriving resets it."""

    async def main() -> dict[str, EventLog]:
        services = LoopbackServices()
        await publish_run(services.registry, [*RUN, "diloco.rounds=3"])
        logs = {n: EventLog() for n in "ab"}
        stop = asyncio.Event()
        peers = {n: Peer(peer_config(None, f"discovery.alone_warning_s={ALONE_S}"), writer=EventWriter(logs[n]),
                         services=services) for n in "ab"}
        tasks = [asyncio.create_task(run_peer(peers["a"], stop))]
        try:
            await until(lambda: any(e.alone_s > 0 for e in logs["a"].rounds()), timeout_s=60,
                        what="a says it is alone", tasks=tasks, logs=logs)
            tasks.append(asyncio.create_task(run_peer(peers["b"], stop)))
            assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done", "done"], story(logs)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return logs

    with caplog.at_level(logging.INFO, logger="swarmtrain.driver"):
        logs = asyncio.run(main())
    told = story(logs)
    lonely = [e for e in logs["a"].rounds() if e.alone_s > 0]
    assert lonely and all(not e.committed and e.alone_s >= ALONE_S for e in lonely), told
    assert all(e.alone_s == 0 for e in logs["a"].rounds() if e.committed), told
    assert [e.round for e in logs["a"].rounds() if e.committed] == [0, 1, 2], told
    said = [r.getMessage() for r in caplog.records if "has seen no other live peer" in r.getMessage()]
    assert len(said) == 1 and "clock is synced" in said[0], said
    again = [r.getMessage() for r in caplog.records if "other live peer(s) of run" in r.getMessage()]
    assert again and all(m.endswith("again") for m in again), again


def test_a_peer_whose_clock_is_behind_the_swarms_says_so_and_announces_the_offset(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another live peer's heartbeats come from a clock 10 s ahead: this peer reports its own clock as
    ~10 s behind in one warning line and in its peer record."""
    skew_s = 10.0

    async def main() -> tuple[Peer, PeerRecord]:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, [*RUN, "diloco.rounds=50", "averaging.min_peers=1"])
        run_id = cfg.train.run_id
        ahead = InMemoryDiscovery(services.registry, run_id=run_id, record_ttl_s=60.0, peer_id="ahead",
                                  skew_s=skew_s)
        stop = asyncio.Event()
        log = EventLog()
        peer = Peer(peer_config(tmp_path / "p"), writer=EventWriter(log), services=services)
        task = asyncio.create_task(run_peer(peer, stop))

        async def beat() -> None:
            while not task.done():
                # a trainer: it counts for the clock but is nobody to heal from or to wait for
                await ahead.announce(PeerRecord(run_id=run_id, peer_id="ahead", endpoint="127.0.0.1:1",
                                                role="trainer", heartbeat_at=ahead.now()), timeout_s=1.0)
                await asyncio.sleep(peer.cfg.discovery.heartbeat_s)

        beats = asyncio.create_task(beat())
        announced: list[PeerRecord] = []

        async def offset_announced() -> None:
            while True:
                mine = [r for r in await live_records(services.registry, run_id) if r.peer_id == peer._peer_id]
                if mine and abs(mine[0].clock_offset_s - skew_s) <= peer.cfg.discovery.heartbeat_s:
                    announced.append(mine[0])
                    return
                await asyncio.sleep(0.05)

        watch = asyncio.create_task(offset_announced())
        try:
            await until(watch.done, timeout_s=60, what="the offset in its peer record", tasks=[task],
                        logs={"p": log})
            stop.set()
            assert await asyncio.wait_for(task, timeout=30) == "signal"
        finally:
            stop.set()
            beats.cancel()
            watch.cancel()
            await asyncio.gather(task, beats, watch, return_exceptions=True)
        assert any(e.committed for e in log.rounds()), story({"p": log})
        return peer, announced[0]

    with caplog.at_level(logging.WARNING, logger="swarmtrain.driver"):
        peer, record = asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "clock is about" in r.getMessage()]
    assert len(said) == 1 and "behind the swarm's" in said[0], said
    heartbeat_s = peer.cfg.discovery.heartbeat_s
    assert peer.presence is not None and abs(peer.presence.clock_offset_s - skew_s) <= heartbeat_s
    assert abs(record.clock_offset_s - skew_s) <= heartbeat_s
