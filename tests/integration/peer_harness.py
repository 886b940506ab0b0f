"""What the Peer integration tests share: real Peers on the in-process cluster (swarmtrain/testing/cluster.py:
loopback gRPC data planes, the in-memory DHT twin, a coordinator that fixes the genesis), their timing, and
the scenarios several of them run (a late joiner, two peers started apart, one peer stopped)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from swarmtrain.config import RunConfig, load_config
from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry, PeerRecord
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.testing.cluster import TINY_RUN, EventLog, LoopbackServices, publish_run, run_peer, story

__all__ = ["LOCAL", "RUN", "live_records", "peer_config", "peers_of", "run_alone_then_stop", "run_started_apart",
           "run_with_late_joiner", "until"]

# A peer's own sections (discovery, rpc) are not the run's: each peer gets the same fast timing locally,
# and the coordinator (which refreshes the run record and the genesis every heartbeat) too, through RUN.
LOCAL = ("discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0", "rpc.call_timeout_s=3.0")
RUN = (
    *TINY_RUN, "averaging.matchmaking_timeout_s=2.0", "averaging.allreduce_timeout_s=10",
    "averaging.contribution_window_s=3", *LOCAL,
)


def peer_config(tmp: Path | None, *more: str) -> RunConfig:
    """A peer's local config: the fast timing, `checkpoint.dir` at `tmp` (none without), and `more`."""
    return load_config(overrides=[*LOCAL, *([f"checkpoint.dir={str(tmp)!r}"] if tmp else []), *more])


async def until(pred: Callable[[], object], *, timeout_s: float, what: str,
                tasks: Sequence[asyncio.Task[str]] = (), logs: Mapping[str, EventLog] | None = None) -> None:
    """Poll `pred` until it holds; a task of `tasks` that ended with an error fails the wait at once with it,
    and the deadline with `what` (and the peers' stories, given `logs`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        for t in tasks:
            if t.done():
                t.result()  # a peer that failed fails the test now, with its exception
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s" + (f": {story(logs)}" if logs else ""))
        await asyncio.sleep(0.02)


async def live_records(registry: InMemoryRegistry, run_id: str) -> tuple[PeerRecord, ...]:
    """The live peer records of `run_id`, as an observer reads them from the DHT twin."""
    observer = InMemoryDiscovery(registry, run_id=run_id, record_ttl_s=60.0, peer_id="observer")
    return await observer.live_peers(timeout_s=1.0)


def peers_of(services: LoopbackServices, logs: Mapping[str, EventLog]) -> dict[str, Peer]:
    """A peer for each log, without a checkpoint directory (their votes kept in memory): what the tests that
    use these look at is the rounds, not what a restart would find."""
    return {n: Peer(peer_config(None), writer=EventWriter(log), services=services) for n, log in logs.items()}


async def run_with_late_joiner(run: Sequence[str], *, rounds: int = 5) -> tuple[dict[str, EventLog], dict[str, Peer]]:
    """a and b train `rounds` rounds; c starts once a committed round 1; all three run to the end."""
    services = LoopbackServices()
    await publish_run(services.registry, [*run, f"diloco.rounds={rounds}"])
    logs = {n: EventLog() for n in "abc"}
    peers = peers_of(services, logs)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_peer(peers[n], stop)) for n in "ab"]
    try:
        await until(lambda: any(e.committed and e.round >= 1 for e in logs["a"].rounds()), timeout_s=60,
                    what="round 1 committed", tasks=tasks, logs=logs)
        tasks.append(asyncio.create_task(run_peer(peers["c"], stop)))
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done"] * 3, story(logs)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return logs, peers


async def run_started_apart(run: Sequence[str]) -> tuple[dict[str, EventLog], dict[str, Peer]]:
    """Peer a runs alone until its first attempt at a round aborts, then b starts; both run to the end."""
    services = LoopbackServices()
    await publish_run(services.registry, run)
    logs = {n: EventLog() for n in "ab"}
    peers = peers_of(services, logs)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_peer(peers["a"], stop))]
    try:
        await until(lambda: any(not e.committed for e in logs["a"].rounds()), timeout_s=60,
                    what="a's lonely round aborted", tasks=tasks, logs=logs)
        tasks.append(asyncio.create_task(run_peer(peers["b"], stop)))
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=60) == ["done"] * 2, story(logs)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return logs, peers


async def run_alone_then_stop(tmp_path: Path, run: Sequence[str]) -> tuple[EventLog, Peer, LoopbackServices]:
    """One peer (min_peers 1) trains until it committed 2 rounds, then is stopped; it must leave on the signal."""
    services = LoopbackServices()
    await publish_run(services.registry, [*run, "diloco.rounds=50", "averaging.min_peers=1"])
    log, stop = EventLog(), asyncio.Event()
    peer = Peer(peer_config(tmp_path / "p"), writer=EventWriter(log), services=services)
    task = asyncio.create_task(run_peer(peer, stop))
    try:
        await until(lambda: len([e for e in log.rounds() if e.committed]) >= 2, timeout_s=60, what="2 rounds",
                    tasks=[task], logs={"p": log})
    finally:
        stop.set()
    assert await asyncio.wait_for(task, timeout=30) == "signal"
    return log, peer, services
