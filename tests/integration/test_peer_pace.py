"""diloco.pace in the Peer (in-process cluster: real matchmaking, all-reduce and round decision over loopback
gRPC, the in-memory DHT twin): a slowed peer takes fewer steps, the fast one more, every round agrees; a healed
peer ends its first round with the swarm; with diloco.pace_align each peer announces its last mean's lag in its
match entries and shifts its span."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from peer_harness import RUN, peer_config, until

from swarmtrain.diloco.pace import PACE_MAX_STEPS_FACTOR
from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry
from swarmtrain.roles import Peer
from swarmtrain.round.group import Member
from swarmtrain.telemetry import EventWriter, HealEvent, RoundEvent
from swarmtrain.testing.cluster import (
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

H, ROUNDS = 6, 4
# Both peers' steps are slowed, one four times more than the other: a round's span (~0.3 s) stays long against the
# scheduling jitter of a loaded machine, which a span of a few unslowed tiny-model steps is not.
FAST_STEP_S, SLOW_STEP_S = 0.02, 0.08


def _slowed(extra_s: float, *, steps: dict[int, int] | None = None,
            prematched: list[int] | None = None) -> Callable[[Peer], None]:
    """What `run_peer` installs on a started peer: every inner step takes `extra_s` longer (a slower machine),
    `steps` counts the inner steps it took in each round, `prematched` gets every round whose matchmaking it
    started before the round's steps were done (a time-paced round's last steps)."""

    def install(peer: Peer) -> None:
        assert peer.worker is not None and peer.part is not None
        step, worker, part = peer.worker._inner_step, peer.worker, peer.part

        def slow_step(loss_sum: torch.Tensor) -> int:
            time.sleep(extra_s)
            if steps is not None:
                steps[worker.round] = steps.get(worker.round, 0) + 1
            return step(loss_sum)

        worker._inner_step = slow_step  # type: ignore[method-assign]
        if prematched is not None:
            prematch = part.prematch

            def spy(round_index: int, member: Member) -> object:
                prematched.append(round_index)
                return prematch(round_index, member)

            part.prematch = spy

    return install


async def _run(tmp_path: Path, run: Sequence[str], installs: dict[str, Callable[[Peer], None]],
               ) -> tuple[dict[str, EventLog], dict[str, Peer], InMemoryRegistry]:
    services = LoopbackServices()
    await publish_run(services.registry, run)
    logs = {n: EventLog() for n in installs}
    peers = {n: Peer(peer_config(tmp_path / n), writer=EventWriter(logs[n]), services=services) for n in installs}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_peer(peers[n], stop, started=installs[n])) for n in installs]
    try:
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done"] * len(tasks), story(logs)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return logs, peers, services.registry


async def _announced_lags(registry: InMemoryRegistry, run_id: str, peer_id: str, rounds: int) -> dict[int, float]:
    """Round -> the lag `peer_id` announced in its match entry of the round's last attempt it entered."""
    observer = InMemoryDiscovery(registry, run_id=run_id, record_ttl_s=60.0, peer_id="observer")
    lags: dict[int, float] = {}
    for r in range(rounds):
        attempt = 0
        while entries := await observer.round_entries(r, attempt, timeout_s=1.0):
            for e in entries:
                if e.member.peer_id == peer_id:
                    lags[r] = e.member.lag_s
            attempt += 1
    return lags


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlap"])
def test_time_paced_peers_split_each_round_by_speed_and_agree(tmp_path: Path, overlap: bool) -> None:
    prematched: dict[str, list[int]] = {"a": [], "b": []}
    run = [*RUN, f"diloco.inner_steps={H}", f"diloco.rounds={ROUNDS}", "diloco.pace=time", "diloco.eval_every_rounds=2",
           f"diloco.overlap={str(overlap).lower()}"]
    logs, _, _ = asyncio.run(_run(tmp_path, run, {"a": _slowed(FAST_STEP_S, prematched=prematched["a"]),
                                                  "b": _slowed(SLOW_STEP_S, prematched=prematched["b"])}))
    told = story(logs)
    for n, rounds in prematched.items():
        # rounds sized by a span enter matchmaking before their Δ is ready (a round retried after
        # an abort, possible for the slow peer when overlapped, averages without it)
        assert rounds and rounds == sorted(set(rounds)) and set(rounds) <= set(range(1, ROUNDS)), (n, rounds, told)
        if not overlap:  # classic: no round starts before the previous commit, every sized round matches early
            assert set(range(2, ROUNDS)) <= set(rounds), (n, rounds, told)
    committed: dict[str, list[RoundEvent]] = {n: [e for e in log.rounds() if e.committed] for n, log in logs.items()}
    fast, slow = ({e.round: e for e in committed[n]} for n in "ab")
    assert sorted(fast) == sorted(slow) == list(range(ROUNDS)), told
    assert all(fast[r].hash == slow[r].hash for r in range(ROUNDS)), "every round committed one θ_global"
    assert fast[0].steps == slow[0].steps == H, "no rates are known before the first round: H steps each"
    assert [fast[r].val_loss is not None for r in range(ROUNDS)] == [r % 2 == 1 for r in range(ROUNDS)], \
        "diloco.eval_every_rounds=2 scores θ_global after every second commit"
    for r in range(1, ROUNDS):  # sized by round r-1's rates: the fast peer trains on while the slow one steps
        assert 1 <= slow[r].steps < fast[r].steps <= PACE_MAX_STEPS_FACTOR * H, (r, slow[r].steps, fast[r].steps)
        # both trained for the same span: the slow peer's compute is not a multiple of the fast one's
        # (overlapped, round 1 began before round 0's commit set the span: only later rounds have one)
        if r >= 2 or not overlap:
            assert slow[r].compute_s < 2.5 * fast[r].compute_s, (r, slow[r].compute_s, fast[r].compute_s)


def test_aligned_peers_announce_their_lag_and_shift_their_span_by_it(tmp_path: Path) -> None:
    run = [*RUN, f"diloco.inner_steps={H}", f"diloco.rounds={ROUNDS}", "diloco.pace=time", "diloco.overlap=true",
           "diloco.pace_align=0.5"]

    async def main() -> tuple[dict[str, EventLog], dict[str, Peer], dict[str, dict[int, float]]]:
        logs, peers, registry = await _run(tmp_path, run, {n: _slowed(0.01) for n in "ab"})
        lags = {n: await _announced_lags(registry, p.cfg.train.run_id, p._peer_id, ROUNDS) for n, p in peers.items()}
        return logs, peers, lags

    logs, peers, lags = asyncio.run(main())
    told = story(logs)
    for n, peer in peers.items():
        comm = {e.round: e.comm_s for e in logs[n].rounds() if e.committed}
        announced = lags[n]
        assert announced[0] == 0.0, "no committed round yet: unknown"
        # round r's Δ goes out before round r-1's mean lands here, or after: it announces one of their comm_s
        for r in range(2, ROUNDS):
            assert announced[r] > 0 and min(abs(announced[r] - comm[r - k]) for k in (1, 2)) < 1e-3, \
                (n, r, announced, comm, told)  # round lines print comm_s to 4 decimals
        span = peer.pace.span_s
        assert span is not None and abs(peer.pace.shift_s) <= span / 4
    # two members: the median is their mean, so their shifts are equal and opposite
    a, b = peers["a"].pace, peers["b"].pace
    assert a.shift_s == pytest.approx(-b.shift_s, abs=1e-9) and a.shift_s != 0.0


@pytest.mark.parametrize("pace", ["steps", "time"])
def test_a_peer_healing_into_a_round_under_way_ends_its_steps_with_the_swarm(tmp_path: Path, pace: str) -> None:
    """c starts while a and b are half-way through round 1. It heals into round 1 and trains only
    for the time the swarm has left in it (their records say when their steps end), so it meets
    them in round 1's group. A full round would end a second after the group closed: c would miss
    it and heal again, every round it joined late (the heal-again cascade)."""
    h, step_s, window_s = 16, 0.08, 1.0  # ~1.3 s per round, longer than the matchmaking window

    async def main() -> tuple[dict[str, EventLog], dict[int, int], int]:
        services = LoopbackServices()
        await publish_run(services.registry, [*RUN, f"diloco.inner_steps={h}", "diloco.rounds=4", f"diloco.pace={pace}",
                                              f"averaging.matchmaking_timeout_s={window_s}"])
        logs = {n: EventLog() for n in "abc"}
        stop = asyncio.Event()
        peers = {n: Peer(peer_config(tmp_path / n), writer=EventWriter(logs[n]), services=services) for n in "abc"}
        a_steps: dict[int, int] = {}
        tasks = [asyncio.create_task(run_peer(peers["a"], stop, started=_slowed(step_s, steps=a_steps))),
                 asyncio.create_task(run_peer(peers["b"], stop, started=_slowed(step_s)))]
        try:
            await until(lambda: a_steps.get(1, 0) >= h // 2, timeout_s=60, what="a half-way through round 1",
                        tasks=tasks, logs=logs)
            a_at_start = a_steps[1]
            tasks.append(asyncio.create_task(run_peer(peers["c"], stop, started=_slowed(step_s))))
            assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done"] * 3, story(logs)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return logs, a_steps, a_at_start

    logs, a_steps, a_at_start = asyncio.run(main())
    told = story(logs)
    heals = [e for e in logs["c"].events() if isinstance(e, HealEvent)]
    assert [(e.from_round, e.to_round) for e in heals] == [(0, 1)], told
    joined = logs["c"].rounds()[0]
    assert joined.round == 1 and joined.committed and len(joined.members) == 3, told
    # the part of round 1 left (at most what a had left when c started, give or take the step nearest the
    # swarm's end), not a whole round
    assert 1 <= joined.steps <= a_steps[1] - a_at_start + 1, (joined.steps, a_at_start, a_steps, told)
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == [0, 1, 2, 3] and all(len(v) == 1 for v in by_round.values()), told
