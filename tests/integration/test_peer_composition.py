"""The Peer composition root over in-memory twins: rounds agree, a late joiner heals, stop checkpoints, restart resumes.

Discovery is the in-memory twin; the data plane is a small windowed all-reduce double defined
here (round r's group = the peers that arrive within a window of the first). Everything runs on
one event loop in this process, no sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from swarmtrain.averaging.protocol import AverageResult, Delta, reader
from swarmtrain.compress import Codec
from swarmtrain.config import ConfigError, DiscoveryConfig, RunConfig, load_config, to_dict
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco.flat import flat_hash
from swarmtrain.discovery import Discovery, InMemoryDiscovery, InMemoryRegistry, PeerRecord, RunRecord
from swarmtrain.peer import Peer, PeerState, merge_run_config
from swarmtrain.peer.services import LivePeerState, PeerError
from swarmtrain.telemetry import EventWriter, HealEvent, LeaveEvent, ReadyLine, RoundEvent, parse_line

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RUN = [
    "model.preset=tiny", "data.max_corpus_bytes=300000", "data.seq_len=32", "data.batch_size=4",
    "inner.warmup_steps=1", "diloco.inner_steps=3", "diloco.eval_batches=1", "averaging.min_peers=2",
    "averaging.matchmaking_timeout_s=0.8", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=1.0",
]


@dataclass
class _Round:
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    lags: dict[str, float] = field(default_factory=dict)
    closed: bool = False
    closes_at: float = 0.0  # unix seconds, the swarm clock of InMemoryRegistry
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: AverageResult | None = None


class WindowedAllReduce:
    """Test double of the network all-reduce with the same commit rule: >= min_peers arrived in the window."""

    def __init__(self, *, window_s: float, min_peers: int) -> None:
        self.window_s = window_s
        self.min_peers = min_peers
        self.rounds: dict[int, _Round] = {}

    async def average(self, peer_id: str, round_index: int, delta: Delta, *,
                      steps_per_s: float = 0.0, lag_s: float = 0.0) -> AverageResult:
        rd = self.rounds.setdefault(round_index, _Round())
        if rd.closed:  # like the matchmaker: a late peer waits out the attempt before trying the round again
            return AverageResult(round=round_index, committed=False, mean=None, reason="late",
                                 retry_at=rd.closes_at + self.window_s)
        if not rd.deltas:
            asyncio.get_running_loop().call_later(self.window_s, self._close, round_index, rd)
            rd.closes_at = time.time() + self.window_s
        rd.deltas[peer_id], rd.rates[peer_id] = reader(delta)(0, delta.numel()).clone(), steps_per_s
        rd.lags[peer_id] = lag_s
        await rd.done.wait()
        assert rd.result is not None
        return rd.result

    def _close(self, round_index: int, rd: _Round) -> None:
        rd.closed = True
        members = tuple(sorted(rd.deltas))
        if len(members) >= self.min_peers:
            mean = torch.zeros_like(rd.deltas[members[0]])
            for m in members:
                mean += rd.deltas[m]
            rd.result = AverageResult(round=round_index, committed=True, mean=mean / len(members), members=members,
                                      bytes_sent=mean.numel() * 4, bytes_received=mean.numel() * 4,
                                      steps_per_s=tuple(rd.rates[m] for m in members),
                                      lags_s=tuple(rd.lags[m] for m in members))
        else:
            rd.result = AverageResult(round=round_index, committed=False, mean=None, members=members,
                                      reason=f"too few peers: {len(members)}")
            del self.rounds[round_index]  # the round is retried
        rd.done.set()


class FakePlane:
    def __init__(self, services: InMemoryServices, peer_id: str) -> None:
        self.services = services
        self.peer_id = peer_id
        self.endpoint = f"127.0.0.1:{20000 + len(services.states)}"
        self.live: LivePeerState | None = None
        self.published: list[tuple[int, str]] = []  # (round, θ hash) of every publish_state
        self.prematched: list[int] = []
        self.lags: list[tuple[int, float]] = []  # (round, lag_s) announced with every Δ (diloco.pace_align)
        services.states[self.endpoint] = self.served

    def served(self) -> PeerState:
        """What a joiner downloads: a copy of the live state, taken as the real plane's server does."""
        assert self.live is not None
        with self.live() as state:
            momentum = None if state.outer_momentum is None else state.outer_momentum.clone()
            return dataclasses.replace(state, theta_global=state.theta_global.clone(), outer_momentum=momentum)

    def serve_state(self, live: LivePeerState) -> None:
        self.live = live

    def publish_state(self, state: PeerState) -> None:
        self.published.append((state.round, state.state_hash))

    async def average(self, round_index: int, delta: Delta, *, steps_per_s: float = 0.0, lag_s: float = 0.0,
                      electorate: tuple[str, ...] = (), on_group: object = None) -> AverageResult:
        # The double's windowed rounds apply the group rule only; the electorate is the all-reduce's
        # (tests/integration/test_swarm_quorum.py runs it on the in-process cluster).
        self.lags.append((round_index, lag_s))
        return await self.services.allreduce.average(self.peer_id, round_index, delta, steps_per_s=steps_per_s,
                                                     lag_s=lag_s)

    async def prematch(self, round_index: int, *, steps_per_s: float, lag_s: float = 0.0) -> None:
        self.prematched.append(round_index)  # the windowed double forms its group when Δ arrives

    def unreported_bytes(self) -> tuple[int, int]:
        return 0, 0  # the double counts every byte in its round results

    async def fetch_state(self, endpoints: Sequence[str], *,
                          param_shapes: object = None) -> tuple[PeerState, tuple[str, ...]]:
        """Like the real plane: several donors must serve one state (a range each), else it fails."""
        states = [self.services.states[e]() for e in endpoints]
        if any(s.round != states[0].round or not torch.equal(s.theta_global, states[0].theta_global) for s in states):
            raise RuntimeError(f"the donors at {list(endpoints)} serve different states")
        return states[0], tuple(endpoints)

    async def aclose(self) -> None:
        self.services.states.pop(self.endpoint, None)


class InMemoryServices:
    def __init__(self, registry: InMemoryRegistry, *, window_s: float) -> None:
        self.registry = registry
        self.allreduce = WindowedAllReduce(window_s=window_s, min_peers=2)
        self.states: dict[str, Callable[[], PeerState]] = {}
        self.ids: dict[str, str] = {}  # identity path -> peer id, so a restarted peer keeps its id

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str, run_key: str) -> Discovery:
        peer_id = self.ids.setdefault(cfg.identity_path, self.registry.new_peer_id()) if cfg.identity_path else None
        return InMemoryDiscovery(self.registry, run_id=run_id, record_ttl_s=cfg.record_ttl_s, peer_id=peer_id,
                                 run_key=run_key)

    async def open_data_plane(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                              param_shapes: Sequence[tuple[str, tuple[int, ...]]], role: str = "worker",
                              before_start: object = None) -> FakePlane:
        return FakePlane(self, discovery.peer_id)

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        return [f"/memory/{discovery.peer_id}"]


async def _publish_run(registry: InMemoryRegistry, cfg: RunConfig) -> None:
    d = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=60.0, peer_id="coordinator")
    await d.publish_run(RunRecord(run_id=cfg.train.run_id, coordinator_id="coordinator", config=to_dict(cfg),
                                  updated_at=registry.clock()), timeout_s=1.0)


class Out(io.StringIO):
    def events(self) -> list[object]:
        return [parse_line(x) for x in self.getvalue().splitlines()]

    def rounds(self) -> list[RoundEvent]:
        return [e for e in self.events() if isinstance(e, RoundEvent)]


async def _until(pred: Callable[[], object], *, timeout_s: float, what: str,
                 tasks: list[asyncio.Task[str]]) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        for t in tasks:
            if t.done():
                t.result()  # a peer that failed fails the test now, with its exception
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.02)


async def _run_peer(peer: Peer, stop: asyncio.Event) -> str:
    reason = "error"
    try:
        await peer.start()
        reason = await peer.run(stop)
    finally:
        await peer.aclose(reason)
    return reason


def _local(tmp: Path | None) -> RunConfig:
    return load_config(overrides=[f"checkpoint.dir={str(tmp)!r}"] if tmp else [])


async def run_with_late_joiner(tmp_path: Path, run: list[str]) -> tuple[dict[str, Out], dict[str, Peer]]:
    """a and b train 5 rounds; c joins once round 1 committed; all three run to the end."""
    registry = InMemoryRegistry()
    await _publish_run(registry, load_config(overrides=[*run, "diloco.rounds=5"]))
    services = InMemoryServices(registry, window_s=0.8)
    outs = {n: Out() for n in "abc"}
    stop = asyncio.Event()
    peers = {n: Peer(_local(tmp_path / n), writer=EventWriter(outs[n]), services=services) for n in "abc"}
    tasks = [asyncio.create_task(_run_peer(peers[n], stop)) for n in "ab"]
    await _until(lambda: any(e.committed and e.round >= 1 for e in outs["a"].rounds()), timeout_s=60,
                 what="round 1 committed", tasks=tasks)
    tasks.append(asyncio.create_task(_run_peer(peers["c"], stop)))
    assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=90) == ["done", "done", "done"]
    return outs, peers


def test_peers_agree_and_a_late_joiner_heals_to_the_swarm(tmp_path: Path) -> None:
    async def main() -> None:
        outs, _ = await run_with_late_joiner(tmp_path, RUN)

        heal = [e for e in outs["c"].events() if isinstance(e, HealEvent)]
        assert heal and heal[0].from_round == 0 and heal[0].to_round >= 2
        by_round: dict[int, set[str]] = {}
        for out in outs.values():
            for e in out.rounds():
                if e.committed:
                    by_round.setdefault(e.round, set()).add(e.hash)
        assert sorted(by_round) == [0, 1, 2, 3, 4] and all(len(h) == 1 for h in by_round.values()), \
            {n: [(e.round, e.committed, e.members, e.hash[:8], e.reason) if isinstance(e, RoundEvent)
                 else ("heal", e.from_round, e.to_round, e.hash[:8]) for e in out.events()
                 if isinstance(e, (RoundEvent, HealEvent))] for n, out in outs.items()}
        assert any(e.committed and len(e.members) == 3 for e in outs["c"].rounds()), "c rejoined the group"
        leaves = [e for out in outs.values() for e in out.events() if isinstance(e, LeaveEvent)]
        assert {e.reason for e in leaves} == {"done"} and len({e.hash for e in leaves}) == 1

    asyncio.run(main())


async def run_started_apart(tmp_path: Path, run: list[str]) -> tuple[dict[str, Out], dict[str, Peer]]:
    """Peer a runs alone until its first round aborts, then b joins; both run to the end."""
    registry = InMemoryRegistry()
    await _publish_run(registry, load_config(overrides=run))
    services = InMemoryServices(registry, window_s=0.8)
    outs = {n: Out() for n in "ab"}
    stop = asyncio.Event()
    peers = {n: Peer(_local(tmp_path / n), writer=EventWriter(outs[n]), services=services) for n in "ab"}
    tasks = [asyncio.create_task(_run_peer(peers["a"], stop))]
    await _until(lambda: any(not e.committed for e in outs["a"].rounds()), timeout_s=60,
                 what="a's lonely round aborted", tasks=tasks)
    tasks.append(asyncio.create_task(_run_peer(peers["b"], stop)))
    assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=60) == ["done", "done"]
    return outs, peers


def test_peers_that_started_apart_meet_in_one_attempt(tmp_path: Path) -> None:
    """a aborts round 0 alone and keeps retrying it with the Δ it trained; b starts later and joins a retry."""

    async def main() -> None:
        outs, _ = await run_started_apart(tmp_path, [*RUN, "diloco.rounds=2"])
        committed = {n: [(e.round, e.hash) for e in out.rounds() if e.committed] for n, out in outs.items()}
        assert committed["a"] == committed["b"] and [r for r, _ in committed["a"]] == [0, 1]
        retries = [e for e in outs["a"].rounds() if e.round == 0]
        assert len(retries) >= 2 and retries[0].compute_s > 0 and all(e.compute_s == 0 for e in retries[1:]), \
            "a retried round 0 without training it again"

    asyncio.run(main())


async def run_alone_then_stop(tmp_path: Path, run: list[str]) -> tuple[Out, Peer, InMemoryServices]:
    """One peer (min_peers 1) trains until 2 rounds committed, then is stopped; it must leave on the signal."""
    registry = InMemoryRegistry()
    await _publish_run(registry, load_config(overrides=[*run, "diloco.rounds=50", "averaging.min_peers=1"]))
    services = InMemoryServices(registry, window_s=0.1)
    services.allreduce.min_peers = 1
    out, stop = Out(), asyncio.Event()
    peer = Peer(_local(tmp_path / "p"), writer=EventWriter(out), services=services)
    task = asyncio.create_task(_run_peer(peer, stop))
    await _until(lambda: len([e for e in out.rounds() if e.committed]) >= 2, timeout_s=60, what="2 rounds",
                 tasks=[task])
    stop.set()
    assert await asyncio.wait_for(task, timeout=30) == "signal"
    return out, peer, services


def test_stop_checkpoints_and_a_restarted_peer_resumes_with_its_id(tmp_path: Path) -> None:
    async def main() -> None:
        out, peer, services = await run_alone_then_stop(tmp_path, RUN)
        registry = services.registry
        (leave,) = [e for e in out.events() if isinstance(e, LeaveEvent)]
        assert leave.reason == "signal" and Path(leave.checkpoint).is_file()
        assert await registry_live(registry, peer.cfg.train.run_id) == (), "leaving withdraws the peer record"

        out2 = Out()
        again = Peer(_local(tmp_path / "p"), writer=EventWriter(out2), services=services)
        info = await again.start()
        assert (info["peer_id"], info["round"], info["hash"]) == (peer._peer_id, leave.round, leave.hash)
        await again.aclose("signal")
        assert isinstance(out2.events()[0], ReadyLine)

    asyncio.run(main())


def test_a_checkpoint_of_another_run_with_the_same_run_id_is_refused_naming_both_nonces(tmp_path: Path) -> None:
    """A checkpoint directory left by an older run of the same run_id (and model) at a later round: the
    new run's nonce differs, so the peer refuses it instead of resuming the old run's weights."""
    async def main() -> None:
        _, peer, _ = await run_alone_then_stop(tmp_path, [*RUN, "train.run_nonce=old"])
        saved = sorted(p.name for p in (tmp_path / "p").iterdir())
        registry = InMemoryRegistry()
        await _publish_run(registry, load_config(overrides=[*RUN, "train.run_nonce=new"]))
        again = Peer(_local(tmp_path / "p"), writer=EventWriter(Out()), services=InMemoryServices(registry, window_s=0.1))
        with pytest.raises(PeerError, match=r"another run of 'swarmtrain' \(nonce 'old', this run's is 'new'\)"):
            await again.start()
        await again.aclose("error")
        assert sorted(p.name for p in (tmp_path / "p").iterdir()) == saved  # nothing written over it
        assert peer.cfg.train.run_nonce == "old"

    asyncio.run(main())


def test_a_finished_peer_serves_state_until_a_straggler_behind_the_last_round_catches_up(tmp_path: Path) -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        cfg = load_config(overrides=[*RUN, "diloco.rounds=2", "averaging.min_peers=1"])
        await _publish_run(registry, cfg)
        services = InMemoryServices(registry, window_s=0.1)
        services.allreduce.min_peers = 1
        straggler = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=60.0, peer_id="straggler")

        async def announce(round_index: int) -> None:
            await straggler.announce(PeerRecord(run_id=cfg.train.run_id, peer_id="straggler",
                                                endpoint="127.0.0.1:1", round=round_index,
                                                heartbeat_at=registry.clock()), timeout_s=1.0)

        await announce(1)  # it missed the last round: it can only finish by healing from a finisher
        out, stop = Out(), asyncio.Event()
        peer = Peer(_local(tmp_path / "p"), writer=EventWriter(out), services=services)
        task = asyncio.create_task(_run_peer(peer, stop))
        await _until(lambda: peer.phase == "lingering", timeout_s=60, what="the run done", tasks=[task])
        assert [e.round for e in out.rounds() if e.committed] == [0, 1] and not task.done()
        served = services.states[peer.endpoint]()
        assert served.round == 2, "it still serves its final state"
        plane = peer.plane
        assert isinstance(plane, FakePlane) and plane.published[-1] == (2, served.state_hash), \
            "the hash it announces is the state it serves"
        assert flat_hash(served.theta_global) == served.state_hash
        await announce(2)  # the straggler healed
        assert await asyncio.wait_for(task, timeout=30) == "done"

    asyncio.run(main())


async def registry_live(registry: InMemoryRegistry, run_id: str) -> tuple[object, ...]:
    d = InMemoryDiscovery(registry, run_id=run_id, record_ttl_s=60.0, peer_id="observer")
    return await d.live_peers(timeout_s=1.0)


def test_merge_keeps_local_sections_and_refuses_run_wide_overrides() -> None:
    swarm = load_config(overrides=["model.preset=small", "rpc.call_timeout_s=9", "train.seed=7"])
    local = load_config(overrides=["rpc.port=5555", "train.threads=1", "model.preset=tiny"])
    merged = merge_run_config(swarm, local, local_overrides=["rpc.port=5555", "train.threads=1"])
    assert merged.model.preset == "small" and merged.train.seed == 7
    assert merged.rpc.port == 5555 and merged.rpc.call_timeout_s == local.rpc.call_timeout_s
    assert merged.train.threads == 1
    with pytest.raises(ConfigError, match=r"model\.preset"):
        merge_run_config(swarm, local, local_overrides=["model.preset=tiny"])


def test_merge_takes_rpc_tls_from_the_run_and_refuses_a_peers_own() -> None:
    """A TLS peer and a plain one cannot talk: rpc.tls is the run's, whatever the peer's file says."""
    for run_tls, local_tls in ((True, False), (False, True)):
        swarm = load_config(overrides=[f"rpc.tls={str(run_tls).lower()}"])
        local = load_config(overrides=[f"rpc.tls={str(local_tls).lower()}", "rpc.port=5555"])
        merged = merge_run_config(swarm, local)
        assert merged.rpc.tls is run_tls and merged.rpc.port == 5555
    with pytest.raises(ConfigError, match=r"rpc\.tls: comes from the swarm"):
        merge_run_config(swarm, local, local_overrides=["rpc.tls=true"])


def test_merge_takes_the_peers_shard_index_and_refuses_one_the_run_has_not() -> None:
    swarm = load_config(overrides=["data.num_shards=4", "data.batch_size=2"])
    local = load_config(overrides=["data.shard_index=3"])
    merged = merge_run_config(swarm, local, local_overrides=["data.shard_index=3"])
    assert (merged.data.num_shards, merged.data.shard_index, merged.data.batch_size) == (4, 3, 2)
    with pytest.raises(ConfigError, match=r"data\.shard_index: 4 is not below data\.num_shards=4"):
        merge_run_config(swarm, load_config(overrides=["data.shard_index=4"]), local_overrides=["data.shard_index=4"])
    with pytest.raises(ConfigError, match=r"data\.batch_size"):
        merge_run_config(swarm, local, local_overrides=["data.batch_size=8"])


def test_peers_of_a_sharded_run_read_the_data_parallel_slots_from_the_start_step(tmp_path: Path) -> None:
    """num_shards=2, start_step=7: peer k reads DDP rank k's windows from step 7 on; the slots never overlap.

    A peer is refused a slot that a live peer reads; a peer given no slot takes the lowest free one,
    and is refused when there is none."""

    async def main() -> None:
        registry = InMemoryRegistry()
        cfg = load_config(overrides=[*RUN, "data.num_shards=2", "data.start_step=7", "train.seed=3"])
        await _publish_run(registry, cfg)
        services = InMemoryServices(registry, window_s=0.1)
        train = load_corpus(cfg.data).train
        seen: list[set[int]] = []
        for k in (0, 1):
            mine = f"data.shard_index={k}"
            peer = Peer(load_config(overrides=[mine]), writer=EventWriter(Out()), services=services,
                        local_overrides=[mine])
            await peer.start()
            try:
                assert peer.worker is not None
                batches = peer.worker.batches
                assert isinstance(batches, ShardedBatches) and batches.position == 7
                rank = ShardedBatches(train, worker_index=k, num_workers=2, batch_size=4, seq_len=32, seed=3)
                for step in range(7, 40):
                    assert torch.equal(batches.windows_at(step), rank.windows_at(step))
                seen.append({int(w) for step in range(7, 40) for w in batches.windows_at(step)})
            finally:
                await peer.aclose("signal")
        assert len(seen[0]) == len(seen[1]) == 33 * 4 and not seen[0] & seen[1]

        first = Peer(load_config(overrides=["data.shard_index=1"]), writer=EventWriter(Out()), services=services)
        await first.start()
        auto = Peer(_local(None), writer=EventWriter(Out()), services=services)
        try:  # a second peer on a slot a live peer reads is refused
            again = Peer(load_config(overrides=["data.shard_index=1"]), writer=EventWriter(Out()), services=services)
            with pytest.raises(PeerError, match=rf"data shard 1 of 2 is already read by live peer {first._peer_id}"):
                await again.start()
            await again.aclose("error")
            await auto.start()  # no slot given: the lowest free one
            assert auto.cfg.data.shard_index == 0 and auto.worker is not None
            assert auto.worker.batches.state_dict()["worker_index"] == 0  # type: ignore[attr-defined]
            full = Peer(_local(None), writer=EventWriter(Out()), services=services)
            with pytest.raises(PeerError, match=r"all 2 data shards of run 'swarmtrain' are read by live peers"):
                await full.start()
            await full.aclose("error")
        finally:
            await auto.aclose("signal")
            await first.aclose("signal")

    asyncio.run(main())


def test_a_run_that_does_not_shard_refuses_a_peer_with_a_shard_index() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        await _publish_run(registry, load_config(overrides=RUN))
        peer = Peer(load_config(overrides=["data.shard_index=0"]), writer=EventWriter(Out()),
                    services=InMemoryServices(registry, window_s=0.1), local_overrides=["data.shard_index=0"])
        with pytest.raises(PeerError, match=r"data\.shard_index=0 is set, but run 'swarmtrain' does not shard"):
            await peer.start()
        await peer.aclose("error")

    asyncio.run(main())


def test_a_restarted_peer_goes_on_in_its_checkpoints_slot_and_refuses_another(tmp_path: Path) -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        await _publish_run(registry, load_config(overrides=[*RUN, "data.num_shards=3"]))
        services = InMemoryServices(registry, window_s=0.1)

        def peer(*slot: str) -> Peer:
            local = [f"checkpoint.dir={str(tmp_path / 'p')!r}", *slot]
            return Peer(load_config(overrides=local), writer=EventWriter(Out()), services=services,
                        local_overrides=local)

        first = peer("data.shard_index=2")
        await first.start()
        await first.aclose("signal")  # leaves a checkpoint of slot 2
        moved = peer("data.shard_index=1")
        with pytest.raises(PeerError, match=r"data layout.*worker_index=2, this stream has 1"):
            await moved.start()
        await moved.aclose("error")  # must not leave a fresh state as the newest checkpoint
        again = peer()
        await again.start()  # no slot given: slots 0 and 1 are free, but its checkpoint read slot 2
        try:
            assert again.cfg.data.shard_index == 2
        finally:
            await again.aclose("signal")

    asyncio.run(main())
