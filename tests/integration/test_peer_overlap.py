"""Peers with diloco.overlap over the in-memory twins: rounds agree, a late joiner heals, aborts keep progress.

Uses the windowed all-reduce double and services of test_peer_composition.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from test_peer_composition import (
    RUN,
    InMemoryServices,
    Out,
    _publish_run,
    _run_peer,
    _until,
    run_alone_then_stop,
    run_started_apart,
    run_with_late_joiner,
)

from swarmtrain.config import load_config
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flatten
from swarmtrain.discovery import InMemoryRegistry
from swarmtrain.peer import Peer
from swarmtrain.telemetry import EventWriter, HealEvent, LeaveEvent, RoundEvent

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

OVERLAP = [*RUN, "diloco.overlap=true"]
# No evaluation after a commit (nor a checkpoint: `_alone`): the mean can be applied on the training thread.
ON_THREAD = [*OVERLAP, "diloco.eval_every_rounds=0", "diloco.inner_steps=6", "diloco.overlap_max_steps=6",
             "diloco.rounds=50", "averaging.min_peers=1"]


async def _alone(tmp_path: Path, stop: asyncio.Event, until: Callable[[Out], bool]) -> tuple[Out, Peer]:
    """One peer (min_peers 1, the double's window 0.1 s, a checkpoint only on leaving) runs until `until`
    holds, then `stop` is set; it must leave on the signal."""
    registry = InMemoryRegistry()
    await _publish_run(registry, load_config(overrides=ON_THREAD))
    services = InMemoryServices(registry, window_s=0.1)
    services.allreduce.min_peers = 1
    out = Out()
    local = load_config(overrides=[f"checkpoint.dir={str(tmp_path / 'p')!r}", "checkpoint.every_rounds=1000"])
    peer = Peer(local, writer=EventWriter(out), services=services)
    task = asyncio.create_task(_run_peer(peer, stop))
    await _until(lambda: until(out), timeout_s=60, what="the peer's rounds", tasks=[task])
    stop.set()
    assert await asyncio.wait_for(task, timeout=30) == "signal"
    return out, peer


def _slow_steps(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every inner step takes `seconds` more, so that a mean (the double's window: 0.1 s) lands mid-round:
    at 0.05 s a round of 6 steps takes 0.3 s, and its mean lands about 2 steps into the next one."""
    step = DilocoWorker._inner_step

    def slow(self: DilocoWorker, loss_sum: torch.Tensor) -> int:
        time.sleep(seconds)
        return step(self, loss_sum)

    monkeypatch.setattr(DilocoWorker, "_inner_step", slow)


def _committed_hashes(outs: dict[str, Out]) -> dict[int, set[str]]:
    by_round: dict[int, set[str]] = {}
    for out in outs.values():
        for e in out.rounds():
            if e.committed:
                by_round.setdefault(e.round, set()).add(e.hash)
    return by_round


def _story(outs: dict[str, Out]) -> dict[str, list[object]]:
    return {n: [(e.round, e.committed, e.members, e.hash[:8], e.reason) if isinstance(e, RoundEvent)
                else ("heal", e.from_round, e.to_round, e.hash[:8]) for e in out.events()
                if isinstance(e, (RoundEvent, HealEvent))] for n, out in outs.items()}


def test_overlapped_peers_agree_and_a_late_joiner_heals(tmp_path: Path) -> None:
    async def main() -> None:
        outs, peers = await run_with_late_joiner(tmp_path, OVERLAP)

        by_round = _committed_hashes(outs)
        assert sorted(by_round) == [0, 1, 2, 3, 4] and all(len(h) == 1 for h in by_round.values()), _story(outs)
        assert any(isinstance(e, HealEvent) for e in outs["c"].events())
        leaves = [e for out in outs.values() for e in out.events() if isinstance(e, LeaveEvent)]
        assert {e.reason for e in leaves} == {"done"} and len({e.hash for e in leaves}) == 1
        for n in "ab":  # every round's inner steps were taken once: H steps per round, none wasted
            assert peers[n].worker is not None and peers[n].worker.inner_step == 5 * 3, n
            assert not peers[n].worker.has_local_progress(), "the last round's average carried everything"

    asyncio.run(main())


def test_an_aborted_overlapped_round_is_sent_again_with_the_newer_progress(tmp_path: Path) -> None:
    """a averages round 0 alone (abort) while training round 1; its retry carries both rounds' steps."""

    async def main() -> None:
        outs, peers = await run_started_apart(tmp_path, [*OVERLAP, "diloco.rounds=3"])
        committed = {n: [(e.round, e.hash) for e in out.rounds() if e.committed] for n, out in outs.items()}
        assert committed["a"] == committed["b"] and [r for r, _ in committed["a"]] == [0, 1, 2], _story(outs)
        # a trained round 1 while its round 0 aborted; that work went into a later Δ, not thrown away.
        worker = peers["a"].worker
        assert worker is not None and worker.inner_step >= 3 * 3

    asyncio.run(main())


def test_stop_during_an_overlapped_round_finishes_its_average_first(tmp_path: Path) -> None:
    async def main() -> None:
        out, _, _ = await run_alone_then_stop(tmp_path, OVERLAP)
        rounds = [e.round for e in out.rounds()]
        assert rounds == list(range(len(rounds))) and all(e.committed for e in out.rounds())
        (leave,) = [e for e in out.events() if isinstance(e, LeaveEvent)]
        assert leave.round == rounds[-1] + 1 and Path(leave.checkpoint).is_file()

    asyncio.run(main())


def test_a_mean_that_lands_mid_round_is_applied_between_two_steps_of_the_running_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_steps(monkeypatch, 0.05)
    training, landed_in_call = threading.local(), []
    train, land = DilocoWorker.train_inner, Peer._land

    def spy_train(self: DilocoWorker, *args: object, **kwargs: object) -> object:
        training.on = True
        try:
            return train(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            training.on = False

    def spy_land(self: Peer, *args: object, **kwargs: object) -> object:
        landed_in_call.append(getattr(training, "on", False))
        return land(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DilocoWorker, "train_inner", spy_train)
    monkeypatch.setattr(Peer, "_land", spy_land)

    async def main() -> None:
        out, peer = await _alone(tmp_path, asyncio.Event(), lambda o: len(o.rounds()) >= 4)
        rounds = out.rounds()
        assert [e.round for e in rounds] == list(range(len(rounds))) and all(e.committed for e in rounds)
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

    def presend_then_stop(self: DilocoWorker) -> object:
        if sys._getframe(1).f_code.co_name == "presend" and not before:
            before.append(flatten(self.params))
            loop.call_soon_threadsafe(stop.set)  # arrives after this Δ was computed, before any launch
        return send(self)

    monkeypatch.setattr(DilocoWorker, "send_overlapped", presend_then_stop)

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        out, peer = await _alone(tmp_path, stop, lambda _: stop.is_set())
        worker = peer.worker
        assert worker is not None and before
        assert torch.equal(flatten(worker.params), before[0]), "θ_local is back where the unsent Δ was taken"
        assert worker.has_local_progress(), "the unsent steps stay in θ_local, for the checkpoint and a resume"
        (leave,) = [e for e in out.events() if isinstance(e, LeaveEvent)]
        assert leave.reason == "signal" and all(e.committed for e in out.rounds())

    loop: asyncio.AbstractEventLoop | None = None
    asyncio.run(main())
