"""diloco.pace in the Peer: a slowed peer takes fewer steps, the fast one more, every round agrees; a healed peer ends
its first round with the swarm; with diloco.pace_align each peer announces its last mean's lag and shifts its span."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.diloco.pace import PACE_MAX_STEPS_FACTOR
from swarmtrain.discovery import InMemoryRegistry
from swarmtrain.peer import Peer
from swarmtrain.telemetry import EventWriter, HealEvent, RoundEvent
from tests.integration.test_peer_composition import RUN, InMemoryServices, Out, _local, _publish_run, _until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

H, ROUNDS, SLOW_STEP_S = 6, 4, 0.05


async def _run_slowed(peer: Peer, stop: asyncio.Event, *, extra_s: float,
                      steps: dict[int, int] | None = None) -> str:
    """Run a peer whose inner steps each take `extra_s` longer (a slower machine); `steps` counts
    the inner steps it took in each round."""
    reason = "error"
    try:
        await peer.start()
        assert peer.worker is not None
        step, worker = peer.worker._inner_step, peer.worker

        def slow_step(loss_sum: torch.Tensor) -> int:
            time.sleep(extra_s)
            if steps is not None:
                steps[worker.round] = steps.get(worker.round, 0) + 1
            return step(loss_sum)

        peer.worker._inner_step = slow_step  # type: ignore[method-assign]
        reason = await peer.run(stop)
    finally:
        await peer.aclose(reason)
    return reason


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlap"])
def test_time_paced_peers_split_each_round_by_speed_and_agree(tmp_path: Path, overlap: bool) -> None:
    async def main() -> dict[str, list[RoundEvent]]:
        registry = InMemoryRegistry()
        run = [*RUN, f"diloco.inner_steps={H}", f"diloco.rounds={ROUNDS}", "diloco.pace=time", "diloco.eval_every_rounds=2",
               f"diloco.overlap={str(overlap).lower()}"]
        await _publish_run(registry, load_config(overrides=run))
        services = InMemoryServices(registry, window_s=0.8)
        outs = {n: Out() for n in "ab"}
        stop = asyncio.Event()
        peers = {n: Peer(_local(tmp_path / n), writer=EventWriter(outs[n]), services=services) for n in "ab"}
        tasks = [asyncio.create_task(_run_slowed(peers["a"], stop, extra_s=0.0)),
                 asyncio.create_task(_run_slowed(peers["b"], stop, extra_s=SLOW_STEP_S))]
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done", "done"]
        for n, peer in peers.items():
            # rounds sized by a span enter matchmaking before their Δ is ready (a round retried after
            # an abort, possible for the slow peer when overlapped, averages without it)
            prematched = peer.plane.prematched  # type: ignore[union-attr]
            assert prematched and prematched == sorted(set(prematched)) \
                and set(prematched) <= set(range(1, ROUNDS)), (n, prematched)
            if not overlap:  # classic: no round starts before the previous commit, every sized round matches early
                assert set(range(2, ROUNDS)) <= set(prematched), (n, prematched)
        return {n: [e for e in out.rounds() if e.committed] for n, out in outs.items()}

    rounds = asyncio.run(main())
    fast, slow = ({e.round: e for e in rounds[n]} for n in "ab")
    assert sorted(fast) == sorted(slow) == list(range(ROUNDS))
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
    async def main() -> tuple[dict[str, Peer], dict[str, Out]]:
        registry = InMemoryRegistry()
        run = [*RUN, f"diloco.inner_steps={H}", f"diloco.rounds={ROUNDS}", "diloco.pace=time", "diloco.overlap=true",
               "diloco.pace_align=0.5"]
        await _publish_run(registry, load_config(overrides=run))
        services = InMemoryServices(registry, window_s=0.8)
        outs = {n: Out() for n in "ab"}
        peers = {n: Peer(_local(tmp_path / n), writer=EventWriter(outs[n]), services=services) for n in "ab"}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_run_slowed(peers[n], stop, extra_s=0.01)) for n in "ab"]
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done", "done"]
        return peers, outs

    peers, outs = asyncio.run(main())
    for n, peer in peers.items():
        comm = {e.round: e.comm_s for e in outs[n].rounds() if e.committed}
        announced = dict(peer.plane.lags)  # type: ignore[union-attr]
        assert announced[0] == 0.0, "no committed round yet: unknown"
        # round r's Δ goes out before round r-1's mean lands here, or after: it announces one of their comm_s
        for r in range(2, ROUNDS):
            assert announced[r] > 0 and min(abs(announced[r] - comm[r - k]) for k in (1, 2)) < 1e-3, \
                (n, r, announced, comm)  # round lines print comm_s to 4 decimals
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
    h, step_s = 16, 0.08  # ~1.3 s per round; the double's group window is 0.8 s

    async def main() -> tuple[dict[str, Out], dict[int, int]]:
        registry = InMemoryRegistry()
        run = [*RUN, f"diloco.inner_steps={h}", "diloco.rounds=4", f"diloco.pace={pace}"]
        await _publish_run(registry, load_config(overrides=run))
        services = InMemoryServices(registry, window_s=0.8)
        outs = {n: Out() for n in "abc"}
        stop = asyncio.Event()
        peers = {n: Peer(_local(tmp_path / n), writer=EventWriter(outs[n]), services=services) for n in "abc"}
        a_steps: dict[int, int] = {}
        tasks = [asyncio.create_task(_run_slowed(peers["a"], stop, extra_s=step_s, steps=a_steps)),
                 asyncio.create_task(_run_slowed(peers["b"], stop, extra_s=step_s))]
        await _until(lambda: a_steps.get(1, 0) >= h // 2, timeout_s=60, what="a half-way through round 1",
                     tasks=tasks)
        tasks.append(asyncio.create_task(_run_slowed(peers["c"], stop, extra_s=step_s)))
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done", "done", "done"]
        return outs, a_steps

    outs, a_steps = asyncio.run(main())
    heals = [e for e in outs["c"].events() if isinstance(e, HealEvent)]
    timeline = [(e.round, e.committed, e.members, e.steps) for e in outs["c"].rounds()]
    assert [(e.from_round, e.to_round) for e in heals] == [(0, 1)], (heals, timeline)
    joined = outs["c"].rounds()[0]
    assert joined.round == 1 and joined.committed and len(joined.members) == 3, timeline
    assert 1 <= joined.steps < a_steps[1], (joined.steps, a_steps)  # the part of round 1 left, not a whole round
    hashes: dict[int, set[str]] = {}
    for out in outs.values():
        for e in out.rounds():
            if e.committed:
                hashes.setdefault(e.round, set()).add(e.hash)
    assert sorted(hashes) == [0, 1, 2, 3] and all(len(v) == 1 for v in hashes.values()), hashes
