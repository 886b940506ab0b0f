"""Rebalancing with the daemon roles on an in-memory DHT and real loopback gRPC: 3 servers on stage 0 and 1
on stage 1 under 2 trainers; stage 1 bounds the pipeline, so one server of stage 0 takes stage 1's state
(checked against the hash stage 1 announces), drains its old stage, serves stage 1 on the port it had (every
role's port is fixed, as behind a firewall), and the trainers' measured samples/s rises. Every server's compute
costs a fixed delay per call (the stage handler's fault seam), so the bottleneck does not depend on how
loaded the machine is."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable

import pytest

from swarmtrain.config import RunConfig, load_config
from swarmtrain.rpc.faults import Fault, FaultSite
from swarmtrain.telemetry import StageMoveEvent, StageRoundEvent, StepEvent
from swarmtrain.testing.roles import RoleSwarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "rebalancing key"
CALL_S = 0.06  # compute seconds every forward and every backward costs a server, on top of its own
RUN = ["model.preset=tiny", "model.n_layer=2", "data.max_corpus_bytes=300000", "data.seq_len=16",
       "inner.warmup_steps=2", "diloco.rounds=1000", "diloco.inner_steps=10", "pipeline.stages=2",
       "pipeline.microbatch_size=2", "pipeline.samples_per_step=8", "pipeline.call_timeout_s=3",
       "pipeline.rebalance=true", "pipeline.rebalance_period_s=0.5", "pipeline.rebalance_margin=0.25",
       "pipeline.rebalance_cooldown_s=6", "pipeline.rebalance_observe_s=1.5", "pipeline.rebalance_drain_s=3",
       "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3", "rpc.call_timeout_s=3",
       "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false"]
SETTLE_S = 3.5  # after the switch: the mover's drain of its old stage (rebalance_drain_s=3) is over
WINDOW_S = 5.0  # of the trainers' steps before the switch, and after it once settled


def _free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now (bound, read, released together)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _fixed_ports() -> Callable[[], RunConfig]:
    """Each role's local config, with a port of its own fixed (gRPC and bulk), as behind a firewall: a server
    that moves must give its old node's port to the new one."""
    ports = iter(_free_ports(2 * 6))

    def local() -> RunConfig:
        return load_config(overrides=[f"rpc.run_key={KEY!r}", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3",
                                      f"rpc.port={next(ports)}", f"rpc.bulk_port={next(ports)}"])

    return local


def _compute_cost(site: FaultSite) -> Fault | None:
    return Fault("delay", CALL_S) if site.call in ("forward", "backward") else None


def _samples_per_s(steps: list[StepEvent], start: float, end: float) -> float:
    """Each trainer's samples a second between its first and last step ending in [start, end], summed."""
    total = 0.0
    for peer in {e.peer for e in steps}:
        mine = [e for e in steps if e.peer == peer and start <= e.at <= end]
        assert len(mine) >= 3, f"trainer {peer}: {len(mine)} steps in a window of {end - start:.1f} s"
        total += sum(e.samples for e in mine[1:]) / (mine[-1].at - mine[0].at)
    return total


def test_a_server_moves_to_the_bottleneck_stage_and_throughput_rises() -> None:
    async def main() -> tuple[RoleSwarm, float]:
        async with RoleSwarm(RUN, run_key=KEY, local=_fixed_ports(), servers={"a": 0, "b": 0, "c": 0, "d": 1},
                             trainers=("t1", "t2"), fault_hook=_compute_cost) as swarm:
            started = time.time()
            endpoints.update({n: role.node.endpoint for n, role in swarm.servers.items() if role.node is not None})
            await swarm.until(lambda: swarm.events(StageMoveEvent), timeout_s=40, what="a move to stage 1")
            switched = swarm.events(StageMoveEvent)[0].at

            def steps_after() -> bool:
                return all(any(e.at > switched + SETTLE_S + WINDOW_S for e in swarm.events(StepEvent, [t]))
                           for t in ("t1", "t2"))

            await swarm.until(steps_after, timeout_s=40, what="the trainers' steps after the move")
            mover = next(n for n, role in swarm.servers.items() if role.moves)
            assert swarm.servers[mover].node is not None
            assert swarm.servers[mover].node.endpoint == endpoints[mover]  # its one port, now serving stage 1
            assert await swarm.finish() == ["signal", "signal"]
        return swarm, started

    t0 = time.monotonic()
    endpoints: dict[str, str] = {}
    swarm, started = asyncio.run(main())
    moves = [(n, e) for n in "abcd" for e in swarm.events(StageMoveEvent, [n])]
    assert len(moves) == 1, moves  # one server moved, and nobody moved back
    name, move = moves[0]
    assert (move.from_stage, move.to_stage) == (0, 1) and swarm.servers[name].stage == 1
    assert move.capacity_per_s[1] < move.capacity_per_s[0] and move.load[1] >= 0.5, move
    assert move.at - started < 30, "the move came later than the bound"
    # The mover took stage 1's θ_global as stage 1 had it (checked against the hash its server announced), and
    # from then on both servers of stage 1 commit the same θ_global every round.
    committed = {n: {e.round: e.hash for e in swarm.events(StageRoundEvent, [n]) if e.committed} for n in (name, "d")}
    if move.round > 0:
        assert committed["d"][move.round] == move.hash
    both = sorted(set(committed[name]) & set(committed["d"]))
    assert both and all(committed[name][r] == committed["d"][r] for r in both), committed
    # In-flight micro-batches were re-sent or finished: none lost.
    steps = swarm.steps()
    assert sum(e.lost for e in steps) == 0
    before = _samples_per_s(steps, move.at - WINDOW_S, move.at)
    after = _samples_per_s(steps, move.at + SETTLE_S, move.at + SETTLE_S + WINDOW_S)
    # Ideally 2x (stage 1's servers double; the two trainers then bound the rate): 1.36-1.65x measured
    # alone and with both cores kept busy; a CI run of the whole suite read 1.25x (with a shorter settle).
    assert after > 1.2 * before, f"samples/s {before:.1f} before the move, {after:.1f} after"
    print(f"rebalanced {name}: stage 0 -> 1 {move.at - started:.1f} s after the trainers started; samples/s "
          f"{before:.1f} -> {after:.1f}; test {time.monotonic() - t0:.1f} s")
