"""A peer whose own round fails (a NaN Δ, an error in its side of the all-reduce) aborts that round,
resynchronises and commits later with the swarm's hash; it never exits and never poisons θ_global.

In-process peers over the in-memory twins of tests/integration/test_peer_composition.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.diloco.worker import InnerStats
from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry, PeerRecord
from swarmtrain.peer import Peer
from swarmtrain.telemetry import EventWriter, HealEvent, RoundEvent
from tests.integration.test_peer_composition import (
    RUN,
    InMemoryServices,
    Out,
    _local,
    _publish_run,
    _run_peer,
    _until,
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


def _fail_average_once(peer: Peer) -> None:
    """The peer's first all-reduce of round BAD_ROUND raises, as a codec or a bug in its own code would."""
    assert peer.plane is not None
    plane, average = peer.plane, peer.plane.average
    done = False

    async def failing(round_index: int, delta: torch.Tensor, **kwargs: float) -> object:
        nonlocal done
        if round_index == BAD_ROUND and not done:
            done = True
            raise RuntimeError("codec exploded")
        return await average(round_index, delta, **kwargs)

    plane.average = failing  # type: ignore[method-assign]


async def _run_three(tmp_path: Path, run: list[str], fault: Callable[[Peer], None] = _poison_once) -> dict[str, Out]:
    registry = InMemoryRegistry()
    await _publish_run(registry, load_config(overrides=[*run, f"diloco.rounds={ROUNDS}"]))
    services = InMemoryServices(registry, window_s=0.8)
    outs = {n: Out() for n in "abc"}
    stop = asyncio.Event()
    peers = {n: Peer(_local(tmp_path / n), writer=EventWriter(outs[n]), services=services) for n in "abc"}

    async def run_c() -> str:
        await peers["c"].start()
        fault(peers["c"])
        reason = "error"
        try:
            reason = await peers["c"].run(stop)
        finally:
            await peers["c"].aclose(reason)
        return reason

    tasks = [asyncio.create_task(_run_peer(peers[n], stop)) for n in "ab"] + [asyncio.create_task(run_c())]
    assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=100) == ["done", "done", "done"]
    return outs


def _trace(outs: dict[str, Out]) -> dict[str, list[object]]:
    return {n: [(e.round, e.committed, len(e.members), e.hash[:8], e.reason) if isinstance(e, RoundEvent)
                else ("heal", e.from_round, e.to_round) for e in out.events() if isinstance(e, (RoundEvent, HealEvent))]
            for n, out in outs.items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlapped"])
def test_a_nan_delta_aborts_that_peers_round_and_it_commits_later(tmp_path: Path, overlap: bool) -> None:
    outs = asyncio.run(_run_three(tmp_path, [*RUN, f"diloco.overlap={'true' if overlap else 'false'}"]))
    trace = _trace(outs)
    bad = [e for e in outs["c"].rounds() if not e.committed and e.reason.startswith("non-finite pseudo-gradient")]
    # overlapped, the steps trained while round BAD_ROUND averages are the next round's: its Δ is the bad one
    assert len(bad) == 1 and bad[0].round == BAD_ROUND + overlap and bad[0].members == (), trace
    by_round: dict[int, set[str]] = {}
    for out in outs.values():
        for e in out.rounds():
            if e.committed:
                by_round.setdefault(e.round, set()).add(e.hash)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), trace
    assert any(e.committed and e.round > bad[0].round for e in outs["c"].rounds()), f"c never committed again: {trace}"


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlapped"])
def test_an_error_in_a_peers_own_all_reduce_aborts_its_round_and_it_goes_on(tmp_path: Path, overlap: bool) -> None:
    outs = asyncio.run(_run_three(tmp_path, [*RUN, f"diloco.overlap={'true' if overlap else 'false'}"],
                                  fault=_fail_average_once))
    trace = _trace(outs)
    failed = [e for e in outs["c"].rounds() if "local error in the all-reduce: RuntimeError: codec exploded" in e.reason]
    assert len(failed) == 1 and failed[0].round == BAD_ROUND and not failed[0].committed, trace
    committed = {(e.round, e.hash) for out in outs.values() for e in out.rounds() if e.committed}
    assert sorted(r for r, _ in committed) == list(range(ROUNDS)), trace  # one hash per round
    assert any(e.committed and e.round > BAD_ROUND for e in outs["c"].rounds()), trace


def test_a_peer_that_sees_no_one_says_so_once_and_in_its_round_lines(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Alone past discovery.alone_warning_s: one warning and alone_s > 0 in round lines; a second peer
    arriving resets it."""

    async def main() -> dict[str, Out]:
        registry = InMemoryRegistry()
        await _publish_run(registry, load_config(overrides=[*RUN, "diloco.rounds=3"]))
        services = InMemoryServices(registry, window_s=0.3)
        outs = {n: Out() for n in "ab"}
        stop = asyncio.Event()
        local = [f"discovery.alone_warning_s={ALONE_S}"]
        peers = {n: Peer(load_config(overrides=[*local, f"checkpoint.dir={str(tmp_path / n)!r}"]),
                         writer=EventWriter(outs[n]), services=services) for n in "ab"}
        tasks = [asyncio.create_task(_run_peer(peers["a"], stop))]
        await _until(lambda: any(e.alone_s > 0 for e in outs["a"].rounds()), timeout_s=60,
                     what="a says it is alone", tasks=tasks)
        tasks.append(asyncio.create_task(_run_peer(peers["b"], stop)))
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done", "done"]
        return outs

    with caplog.at_level(logging.INFO, logger="swarmtrain.peer"):
        outs = asyncio.run(main())
    lonely = [e for e in outs["a"].rounds() if e.alone_s > 0]
    assert lonely and all(not e.committed and e.alone_s >= ALONE_S for e in lonely)
    assert all(e.alone_s == 0 for e in outs["a"].rounds() if e.committed)
    said = [r.getMessage() for r in caplog.records if "has seen no other live peer" in r.getMessage()]
    assert len(said) == 1 and "clock is synced" in said[0], said
    assert any("again" in r.getMessage() for r in caplog.records if r.name.startswith("swarmtrain.peer"))


def test_a_peer_whose_clock_is_behind_the_swarms_says_so_and_announces_the_offset(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another live peer's heartbeats come from a clock 10 s ahead: this peer reports its own clock as
    ~10 s behind in one warning line and in its peer record."""
    skew_s = 10.0

    async def main() -> Peer:
        registry = InMemoryRegistry()
        cfg = load_config(overrides=[*RUN, "diloco.rounds=3", "averaging.min_peers=1"])
        await _publish_run(registry, cfg)
        services = InMemoryServices(registry, window_s=0.1)
        services.allreduce.min_peers = 1
        ahead = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=60.0, peer_id="ahead")
        stop = asyncio.Event()
        peer = Peer(_local(tmp_path / "p"), writer=EventWriter(Out()), services=services)
        task = asyncio.create_task(_run_peer(peer, stop))

        async def beat() -> None:
            while not task.done():
                # a trainer: it counts for the clock but is nobody to heal from or to wait for
                await ahead.announce(PeerRecord(run_id=cfg.train.run_id, peer_id="ahead", endpoint="127.0.0.1:1",
                                                role="trainer", heartbeat_at=registry.clock() + skew_s), timeout_s=1.0)
                await asyncio.sleep(cfg.discovery.heartbeat_s)

        beats = asyncio.create_task(beat())
        assert await asyncio.wait_for(task, timeout=60) == "done"
        beats.cancel()
        return peer

    with caplog.at_level(logging.WARNING, logger="swarmtrain.peer"):
        peer = asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "clock is about" in r.getMessage()]
    assert len(said) == 1 and "behind the swarm's" in said[0], said
    heartbeat_s = peer.cfg.discovery.heartbeat_s
    assert peer.presence is not None and abs(peer.presence.clock_offset_s - skew_s) <= heartbeat_s
    assert peer._record().clock_offset_s == peer.presence.clock_offset_s
