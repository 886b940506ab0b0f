"""Gossip rounds (averaging.mode = "gossip") with real Peers on the in-process cluster: every peer runs its own
rounds with partners drawn from the roster, a late joiner copies a live peer, and a dead or lying partner
costs one exchange, never a round of the swarm: nobody waits past `averaging.gossip_timeout_s`."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from peer_harness import RUN, peers_of, until

from swarmtrain.driver.gossip import GossipDriver
from swarmtrain.roles import Peer
from swarmtrain.rpc.gossip_wire import GossipPart
from swarmtrain.telemetry import HealEvent, RoundEvent
from swarmtrain.testing.cluster import EventLog, LoopbackServices, publish_run, run_peer, story

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TIMEOUT_S = 2.0
GOSSIP = (*RUN, 'averaging.mode="gossip"', f"averaging.gossip_timeout_s={TIMEOUT_S}")


async def _swarm(names: str, rounds: int, *, extra: tuple[str, ...] = (),
                 started: Callable[[str, Peer], None] | None = None,
                 during: Callable[[dict[str, EventLog], dict[str, Peer]], object] | None = None
                 ) -> tuple[dict[str, EventLog], dict[str, Peer], list[str]]:
    services = LoopbackServices()
    await publish_run(services.registry, [*GOSSIP, f"diloco.rounds={rounds}", *extra])
    logs = {n: EventLog() for n in names}
    peers = peers_of(services, logs)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_peer(peers[n], stop, started=None if started is None else
                                          (lambda p, n=n: started(n, p)))) for n in names]
    try:
        if during is not None:
            await during(logs, peers)  # type: ignore[misc]
        reasons = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=150)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return logs, peers, [r if isinstance(r, str) else repr(r) for r in reasons]


def _rounds(log: EventLog) -> list[RoundEvent]:
    return [e for e in log.rounds() if e.committed]


def _start(log: EventLog) -> int:
    """The round a peer's first round line is of: 0, or the round of the live peer it copied at its start."""
    heals = [e for e in log.events() if isinstance(e, HealEvent)]
    return heals[0].to_round if heals else 0


def test_peers_gossip_in_pairs_each_on_its_own() -> None:
    async def main() -> None:
        services_rounds = 6
        logs, peers, reasons = await _swarm("abcd", services_rounds)
        assert reasons == ["done"] * 4, story(logs)
        ids = {n: p.discovery.peer_id for n, p in peers.items() if p.discovery is not None}
        for n in "abcd":
            lines = _rounds(logs[n])
            # one line per round, in order, from round 0 or the round of the peer it copied (a slow start)
            assert [e.round for e in lines] == list(range(_start(logs[n]), services_rounds)), story(logs)
            paired = [e for e in lines if len(e.members) == 2]
            assert 2 * len(paired) >= len(lines), story(logs)  # a partner in most rounds (start-up, slow ones aside)
            assert all(e.spread is not None and math.isfinite(e.spread) for e in paired)
            assert all(set(e.members) <= set(ids.values()) for e in lines)
            assert all(e.loss is not None and math.isfinite(e.loss) for e in lines)
        # the replicas are not one θ_global: gossip keeps them close, not equal
        finals = {_rounds(logs[n])[-1].hash for n in "abcd"}
        assert len(finals) > 1

    asyncio.run(main())


def test_a_late_joiner_starts_from_a_live_peer_s_state() -> None:
    async def main() -> None:
        services = LoopbackServices()
        await publish_run(services.registry, [*GOSSIP, "diloco.rounds=6"])
        logs = {n: EventLog() for n in "abc"}
        peers = peers_of(services, logs)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_peer(peers[n], stop)) for n in "ab"]
        try:
            await until(lambda: len(_rounds(logs["a"])) >= 3, timeout_s=60, what="a's third round", tasks=tasks,
                        logs=logs)
            tasks.append(asyncio.create_task(run_peer(peers["c"], stop)))
            assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=120) == ["done"] * 3, story(logs)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        heals = [e for e in logs["c"].events() if isinstance(e, HealEvent)]
        ids = {n: p.discovery.peer_id for n, p in peers.items() if p.discovery is not None}
        assert len(heals) == 1 and heals[0].from_round == 0 and heals[0].to_round >= 2, story(logs)
        assert heals[0].source in (ids["a"], ids["b"])
        first = _rounds(logs["c"])[0]
        assert first.round == heals[0].to_round  # it trains on from the copied round, not from round 0

    asyncio.run(main())


def test_a_dead_partner_costs_each_peer_at_most_one_timeout_per_round() -> None:
    async def kill_c(logs: dict[str, EventLog], peers: dict[str, Peer]) -> None:
        await until(lambda: all(len(_rounds(logs[n])) >= 2 for n in "abc"), timeout_s=60, what="round 2 everywhere",
                    logs=logs)
        plane, discovery = peers["c"].plane, peers["c"].discovery
        assert plane is not None and discovery is not None

        async def not_withdrawn(*, timeout_s: float) -> None:  # a killed process withdraws nothing
            return None

        discovery.withdraw = not_withdrawn  # type: ignore[method-assign]
        await asyncio.to_thread(plane.node.close)  # its record stays listed until its TTL: it looks alive

    async def main() -> None:
        logs, peers, reasons = await _swarm("abc", 8, during=kill_c)
        assert reasons[:2] == ["done", "done"], story(logs)
        c_id = peers["c"].discovery.peer_id if peers["c"].discovery is not None else "?"
        # c, drawn as a partner after it died (until its record expires), cost that exchange
        assert any(c_id in e.reason for n in "ab" for e in _rounds(logs[n])), story(logs)
        for n in "ab":
            lines = _rounds(logs[n])
            assert [e.round for e in lines] == list(range(_start(logs[n]), 8)), story(logs)
            # nobody waits for the swarm: a round's exchange ends within the gossip timeout (and some slack for
            # the roster read, the encode and the step of a loaded machine)
            assert max(e.comm_s for e in lines) < TIMEOUT_S + 4.0, [(e.round, e.comm_s) for e in lines]
            # of which the wait for the partners is at most one timeout (its deadline, then the loop's latency)
            waits = [e.wait_s for e in lines]
            assert all(w is not None and w <= e.comm_s and w < TIMEOUT_S + 1.0 for w, e in zip(waits, lines,
                                                                                              strict=True)), waits

    asyncio.run(main())


def test_a_lying_partner_is_clipped_or_left_out() -> None:
    def lie(name: str, peer: Peer) -> None:
        if name != "c":
            return
        driver = peer.gossip
        assert isinstance(driver, GossipDriver)
        honest = driver._encode

        def encode(round_index: int, delta: torch.Tensor) -> GossipPart:
            if round_index % 3 == 0:  # a Δ a million times too large
                return honest(round_index, delta * 1e6)
            if round_index % 3 == 1:  # a Δ of another model's size, under the honest header
                return honest(round_index, delta[:-5])
            part = honest(round_index, delta)  # bytes that do not decode (an honest codec cannot send NaN either)
            return dataclasses.replace(part, delta=part.delta[:-3] + b"bad")

        driver._encode = encode  # type: ignore[method-assign]

    async def main() -> None:
        logs, _, reasons = await _swarm("abc", 6, extra=("compress.codec=fp32",), started=lie)
        assert reasons == ["done"] * 3, story(logs)
        seen = " ".join(e.reason for n in "ab" for e in _rounds(logs[n]))
        assert "clipped" in seen and "values, not" in seen and "does not decode" in seen, story(logs)
        for n in "ab":
            assert all(e.loss is not None and math.isfinite(e.loss) for e in _rounds(logs[n])), story(logs)
            assert all(e.spread is None or math.isfinite(e.spread) for e in _rounds(logs[n]))

    asyncio.run(main())
