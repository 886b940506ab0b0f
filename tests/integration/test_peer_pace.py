"""diloco.pace "time" in the Peer: a slowed peer takes fewer steps, the fast one more, and every round still agrees."""

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
from swarmtrain.telemetry import EventWriter, RoundEvent
from tests.integration.test_peer_composition import RUN, InMemoryServices, Out, _local, _publish_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

H, ROUNDS, SLOW_STEP_S = 6, 4, 0.05


async def _run_slowed(peer: Peer, stop: asyncio.Event, *, extra_s: float) -> str:
    """Run a peer whose inner steps each take `extra_s` longer (a slower machine)."""
    reason = "error"
    try:
        await peer.start()
        assert peer.worker is not None
        step = peer.worker._inner_step

        def slow_step(loss_sum: torch.Tensor) -> int:
            time.sleep(extra_s)
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
