"""Peers with diloco.overlap on the in-process cluster (real matchmaking, all-reduce and round decision over
loopback gRPC, the in-memory DHT twin): rounds agree, a late joiner heals, aborts keep progress, a mean lands
between two inner steps, a Δ computed and not sent goes back into θ_local."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peer_harness import RUN, peer_config, run_alone_then_stop, run_started_apart, run_with_late_joiner, until

from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flatten
from swarmtrain.peer.part import WorkerPart
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter, HealEvent, LeaveEvent
from swarmtrain.testing.cluster import (
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

OVERLAP = [*RUN, "diloco.overlap=true"]
# No evaluation after a commit (nor a checkpoint: `_alone`): the mean can be applied on the training thread.
ON_THREAD = [*OVERLAP, "diloco.eval_every_rounds=0", "diloco.inner_steps=6", "diloco.overlap_max_steps=6",
             "diloco.rounds=50", "averaging.min_peers=1"]


async def _alone(tmp_path: Path, stop: asyncio.Event, until_: Callable[[EventLog], bool]) -> tuple[EventLog, Peer]:
    """One peer (min_peers 1, a checkpoint only on leaving) runs until `until_` holds, then `stop` is set; it
    must leave on the signal."""
    services = LoopbackServices()
    await publish_run(services.registry, ON_THREAD)
    log = EventLog()
    peer = Peer(peer_config(tmp_path / "p", "checkpoint.every_rounds=1000"), writer=EventWriter(log),
                services=services)
    task = asyncio.create_task(run_peer(peer, stop))
    try:
        await until(lambda: until_(log), timeout_s=60, what="the peer's rounds", tasks=[task], logs={"p": log})
    finally:
        stop.set()
    assert await asyncio.wait_for(task, timeout=30) == "signal"
    return log, peer


def _slow_steps(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every inner step takes `seconds` more, so that a mean lands mid-round: at 0.05 s a round of 6 steps
    takes 0.3 s, longer than a lone peer's round of matchmaking, all-reduce and decision on loopback."""
    step = DilocoWorker._inner_step

    def slow(self: DilocoWorker, loss_sum: torch.Tensor) -> int:
        time.sleep(seconds)
        return step(self, loss_sum)

    monkeypatch.setattr(DilocoWorker, "_inner_step", slow)


def test_overlapped_peers_agree_and_a_late_joiner_heals() -> None:
    async def main() -> None:
        logs, peers = await run_with_late_joiner(OVERLAP)
        told = story(logs)
        by_round = hashes_by_round(logs)
        assert sorted(by_round) == [0, 1, 2, 3, 4] and all(len(h) == 1 for h in by_round.values()), told
        heals = [e for e in logs["c"].events() if isinstance(e, HealEvent)]
        assert heals and heals[0].from_round == 0, told
        committed = {e.round + 1: e.hash for n in "ab" for e in logs[n].rounds() if e.committed}
        assert all(committed[e.to_round] == e.hash for e in heals), told
        assert any(e.committed and len(e.members) == 3 for e in logs["c"].rounds()), told
        leaves = [e for log in logs.values() for e in log.events() if isinstance(e, LeaveEvent)]
        assert {e.reason for e in leaves} == {"done"} and len({e.hash for e in leaves}) == 1, leaves
        for n in "ab":  # every round committed at its first attempt: H steps per round, none wasted
            assert [e.round for e in logs[n].rounds()] == [0, 1, 2, 3, 4], told
            worker = peers[n].worker
            assert worker is not None and worker.inner_step == 5 * 3, (n, worker.inner_step if worker else None)
            assert not worker.has_local_progress(), "the last round's average carried everything"

    asyncio.run(main())


def test_an_aborted_overlapped_round_is_sent_again_with_the_newer_progress() -> None:
    """a averages round 0 alone (abort) while training round 1; its retry carries both rounds' steps."""

    async def main() -> None:
        logs, peers = await run_started_apart([*OVERLAP, "diloco.rounds=3"])
        told = story(logs)
        committed = {n: [(e.round, e.hash) for e in log.rounds() if e.committed] for n, log in logs.items()}
        assert committed["a"] == committed["b"] and [r for r, _ in committed["a"]] == [0, 1, 2], told
        # a trained round 1 while its round 0 aborted; that work went into a later Δ, not thrown away.
        worker = peers["a"].worker
        assert worker is not None and worker.inner_step >= 3 * 3, worker.inner_step if worker else None

    asyncio.run(main())


def test_stop_during_an_overlapped_round_finishes_its_average_first(tmp_path: Path) -> None:
    async def main() -> None:
        log, _, _ = await run_alone_then_stop(tmp_path, OVERLAP)
        rounds = [e.round for e in log.rounds()]
        assert rounds == list(range(len(rounds))) and all(e.committed for e in log.rounds()), story({"p": log})
        (leave,) = [e for e in log.events() if isinstance(e, LeaveEvent)]
        assert leave.round == rounds[-1] + 1 and leave.checkpoint and Path(leave.checkpoint).is_file()

    asyncio.run(main())


def test_a_mean_that_lands_mid_round_is_applied_between_two_steps_of_the_running_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_steps(monkeypatch, 0.05)
    training, landed_in_call = threading.local(), []
    train, land = DilocoWorker.train_inner, WorkerPart.land

    def spy_train(self: DilocoWorker, *args: object, **kwargs: object) -> object:
        training.on = True
        try:
            return train(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            training.on = False

    def spy_land(self: WorkerPart, *args: object, **kwargs: object) -> object:
        landed_in_call.append(getattr(training, "on", False))
        return land(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DilocoWorker, "train_inner", spy_train)
    monkeypatch.setattr(WorkerPart, "land", spy_land)

    async def main() -> None:
        log, peer = await _alone(tmp_path, asyncio.Event(), lambda o: len(o.rounds()) >= 4)
        rounds = log.rounds()
        assert [e.round for e in rounds] == list(range(len(rounds))) and all(e.committed for e in rounds), \
            story({"p": log})
        assert any(landed_in_call), f"no mean was applied inside a training call: {landed_in_call}"
        worker = peer.worker
        assert worker is not None and worker.inner_step >= 6 * len(rounds)

    asyncio.run(main())


def test_a_delta_computed_at_the_end_of_a_round_and_not_sent_goes_back_into_theta_local(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop right after the training thread computed the next Δ: θ_local returns to where it was."""
    _slow_steps(monkeypatch, 0.05)
    send = DilocoWorker.send_overlapped
    before: list[torch.Tensor] = []
    stop = asyncio.Event()
    loop: asyncio.AbstractEventLoop | None = None

    def presend_then_stop(self: DilocoWorker) -> object:
        if sys._getframe(1).f_code.co_name == "presend" and not before:
            before.append(flatten(self.params))
            assert loop is not None
            loop.call_soon_threadsafe(stop.set)  # arrives after this Δ was computed, before any launch
        return send(self)

    monkeypatch.setattr(DilocoWorker, "send_overlapped", presend_then_stop)

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        log, peer = await _alone(tmp_path, stop, lambda _: stop.is_set())
        worker = peer.worker
        assert worker is not None and before
        assert torch.equal(flatten(worker.params), before[0]), "θ_local is back where the unsent Δ was taken"
        assert worker.has_local_progress(), "the unsent steps stay in θ_local, for the checkpoint and a resume"
        (leave,) = [e for e in log.events() if isinstance(e, LeaveEvent)]
        assert leave.reason == "signal" and all(e.committed for e in log.rounds()), story({"p": log})

    asyncio.run(main())
