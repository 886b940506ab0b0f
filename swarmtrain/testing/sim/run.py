"""The deterministic simulation tester: a seed draws a swarm (5-9 peers, clocks skewed by up to ±8 s) and a
schedule of faults (crashes and restarts at any moment, frozen peers, partitions, stale DHT reads, lost calls,
graceful leaves for good), runs the production round code against it on virtual time, and checks the outcome:

* **safety**: no round has two states anywhere: every commit of round r, on any peer and any incarnation,
  leads to one state digest, and every state held at a round (committed into, or adopted by a heal) is that
  one;
* **liveness**: once the faults stop (every crashed peer restarted, every link and clock back), every peer that
  did not leave commits a round past the newest committed before, within `liveness_spans` attempt spans;
* **no spinning**: no peer's driver attempts more than `MAX_ATTEMPTS_PER_SPAN` rounds per attempt span, and
  the loop never runs long without virtual time moving;
* no handler or task failed with an error of the code's own (a bug, not a network fault).

A failing seed replays exactly: `run_schedule(Schedule.draw(seed))` (with the same PYTHONHASHSEED).
"""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarmtrain.config import RunConfig, load_config
from swarmtrain.discovery import InMemoryDiscovery
from swarmtrain.discovery.coordinator import RunPublisher
from swarmtrain.testing.sim.dht import SimRegistry
from swarmtrain.testing.sim.loop import SimDeadlock, VirtualLoop, run_virtual
from swarmtrain.testing.sim.network import SimNetwork, SimNode
from swarmtrain.testing.sim.part import Ledger
from swarmtrain.testing.sim.peer import SimPeer

__all__ = ["Fault", "Schedule", "SimResult", "fast_tmp", "run_schedule", "sim_config", "start_coordinator"]

log = logging.getLogger(__name__)

MAX_ATTEMPTS_PER_SPAN = 12

# The workload's timing: windows of a second, so that a schedule of a few minutes of virtual time covers
# dozens of rounds; the record TTL outlasts the clock skew (±8 s) as the configuration docs require.
SIM_RUN = (
    "train.run_id=sim", "train.run_nonce=0123456789abcdef", "rpc.run_key=simulation-key",
    "averaging.min_peers=2", "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=3.0",
    "averaging.contribution_window_s=0.5", "averaging.max_retries=1", "discovery.heartbeat_s=0.5",
    "discovery.record_ttl_s=20.0", "discovery.max_clock_skew_s=20.0", "rpc.call_timeout_s=1.0",
    "diloco.rounds=100000", "compress.codec=int8", "outer.lr=0.7", "outer.momentum=0.9",
)


def sim_config(*extra: str) -> RunConfig:
    return load_config(overrides=[*SIM_RUN, *extra])


@dataclass(frozen=True)
class Fault:
    """At virtual time `at`: `kind` one of crash (restart `down_s` later), freeze (for `down_s`), partition
    (into `sides` until `down_s` later), stale (DHT reads stale with probability `rate` for `down_s`), or
    mean_crash: from `at` on, `peer` crashes as soon as its answer with a mean of round `round` reaches peer
    `to` (with `to` < 0: any other peer, the first it serves; restarting `down_s` later): a reducer dying between
    serving one member and the others; push_crash: the same once its answer to `to`'s push of round `round`
    reaches `to` (a reducer dying while the members push); leave: `peer` leaves gracefully (its voter retires,
    its departure is announced) for good, at `at`, or (with `round` >= 0)
    as soon as it has promised a ballot of round `round`, after `at`."""

    at: float
    kind: str
    peer: int = -1
    down_s: float = 0.0
    sides: tuple[tuple[int, ...], ...] = ()
    rate: float = 0.0
    to: int = -1
    round: int = -1


@dataclass(frozen=True)
class Schedule:
    seed: int
    peers: int
    skews_s: tuple[float, ...]
    faults: tuple[Fault, ...]
    faults_until_s: float
    liveness_spans: float = 20.0
    drop: float = 0.0
    checkpoint_every: int = 1
    numel: int = 32
    rules: str = "paxos"  # or "legacy": the voting rules before the decision was consensus (legacy.py)
    config: tuple[str, ...] = ()  # overrides of the simulation's run config (SIM_RUN)

    @classmethod
    def draw(cls, seed: int, *, peers: tuple[int, int] = (5, 9), faults_until_s: float = 90.0,
             max_skew_s: float = 8.0) -> Schedule:
        """The schedule of `seed`: a swarm, its clocks, and faults spread over [10 s, faults_until_s)."""
        rng = random.Random(seed)
        n = rng.randint(*peers)
        skews = tuple(round(rng.uniform(-max_skew_s, max_skew_s), 3) for _ in range(n))
        faults: list[Fault] = []
        left: set[int] = set()
        t = rng.uniform(5.0, 15.0)
        while t < faults_until_s:
            kind = rng.choice(("crash", "crash", "crash", "freeze", "partition", "stale", "leave"))
            down = rng.uniform(1.0, 25.0)
            if kind == "leave" and len(left) + 3 >= n:  # at least 3 peers stay for good
                kind = "crash"
            if kind == "partition":
                members = list(range(n))
                rng.shuffle(members)
                cut = rng.randint(1, n - 1)
                faults.append(Fault(t, kind, down_s=down, sides=(tuple(members[:cut]), tuple(members[cut:]))))
            elif kind == "stale":
                faults.append(Fault(t, kind, down_s=down, rate=rng.uniform(0.1, 0.6)))
            elif kind == "leave":
                peer = rng.choice([i for i in range(n) if i not in left])
                left.add(peer)
                faults.append(Fault(t, kind, peer=peer))
            else:
                faults.append(Fault(t, kind, peer=rng.randrange(n), down_s=down))
            t += rng.expovariate(1 / 8.0)
        return cls(seed, n, skews, tuple(faults), faults_until_s, drop=rng.choice((0.0, 0.0, 0.02)),
                   checkpoint_every=rng.choice((1, 1, 2, 3)))


@dataclass
class SimResult:
    schedule: Schedule
    safety: list[str] = field(default_factory=list)
    liveness: list[str] = field(default_factory=list)
    bugs: list[str] = field(default_factory=list)
    rounds: int = 0  # the newest round committed anywhere
    rounds_at_faults_end: int = 0
    recovered_s: float | None = None  # virtual seconds from the faults' end until every peer committed past them
    virtual_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the schedule's targeted faults did, and when
    ledger: Ledger | None = None  # every commit, heal and attempt of the run

    @property
    def ok(self) -> bool:
        return not (self.safety or self.liveness or self.bugs)

    def summary(self) -> str:
        s = self.schedule
        return (f"seed {s.seed}: {s.peers} peers, {len(s.faults)} faults, rounds {self.rounds_at_faults_end} at the "
                f"faults' end, {self.rounds} in all, recovered in {self.recovered_s}; "
                + ("ok" if self.ok else f"SAFETY {self.safety[:3]} LIVENESS {self.liveness[:3]} BUGS {self.bugs[:3]}"))


def run_schedule(schedule: Schedule, *, directory: Path | None = None) -> SimResult:
    """Run one schedule on a fresh virtual loop (see the module docstring)."""
    random.seed(schedule.seed)  # what production code draws (retry jitter) follows the seed too
    with tempfile.TemporaryDirectory(prefix="swarmtrain-sim-", dir=fast_tmp()) as tmp:
        root = directory if directory is not None else Path(tmp)
        return run_virtual(lambda: _run(schedule, root))


def fast_tmp() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


async def _run(schedule: Schedule, root: Path) -> SimResult:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    clock = loop.clock
    cfg = sim_config(*schedule.config)
    rng = random.Random(schedule.seed * 7919 + 1)
    registry = SimRegistry(clock=clock.wall, rng=random.Random(schedule.seed * 31 + 7), key_seed=b"sim-keys")
    net = SimNetwork(rng=rng, drop=schedule.drop)
    ledger = Ledger()
    result = SimResult(schedule, ledger=ledger)
    stop_publisher, publishing = await start_coordinator(registry, cfg)
    peers = [SimPeer(index=i, cfg=cfg, net=net, registry=registry, ledger=ledger, directory=root / f"p{i:02d}",
                     skew_s=schedule.skews_s[i], seed=schedule.seed, numel=schedule.numel, train_s=1.0,
                     checkpoint_every=schedule.checkpoint_every, dht_latency_s=0.005, rules=schedule.rules)
             for i in range(schedule.peers)]
    for p in peers:
        p.start()
        await asyncio.sleep(rng.uniform(0.0, 0.5))
    span_s = _attempt_span_s(cfg)
    try:
        await _faults(schedule, peers, net, registry, result.notes)
        await _end_faults(peers, net, registry)
        result.rounds_at_faults_end = max((p.part.round for p in peers if p.part is not None), default=0)
        result.recovered_s = await _until_recovered(peers, past=result.rounds_at_faults_end,
                                                    limit_s=schedule.liveness_spans * span_s)
        if result.recovered_s is None:
            behind = {p.peer_id: p.part.round if p.part else None for p in peers}
            result.liveness.append(f"no commit past round {result.rounds_at_faults_end} on every peer within "
                                   f"{schedule.liveness_spans:g} attempt spans of the faults' end: {behind}")
    except SimDeadlock as e:
        result.liveness.append(f"deadlock: {e}")
    finally:
        stop_publisher.set()
        for p in peers:
            p.crash()
        publishing.cancel()
    result.virtual_s = clock.now
    result.rounds = max((r for _, _, r, _, _ in ledger.commits), default=-1) + 1
    result.safety = check_safety(ledger)
    result.liveness += check_spinning(ledger, peers=[p.peer_id for p in peers], span_s=span_s)
    result.bugs = list(net.bugs)
    return result


async def start_coordinator(registry: SimRegistry, cfg: RunConfig) -> tuple[asyncio.Event, asyncio.Future[None]]:
    """The run's coordinator on the simulated DHT: publishes the run record and the genesis until the event."""
    coordinator = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=3600.0, peer_id="coordinator",
                                    run_key=cfg.rpc.run_key)
    publisher = RunPublisher(coordinator, cfg)
    await publisher.publish()
    stop = asyncio.Event()
    return stop, asyncio.ensure_future(publisher.serve(stop))


def _attempt_span_s(cfg: RunConfig) -> float:
    a = cfg.averaging
    window = a.matchmaking_timeout_s
    return 0.25 * window + max(window, 1.0) + a.allreduce_timeout_s + max(window, 2.0)


async def _faults(schedule: Schedule, peers: Sequence[SimPeer], net: SimNetwork, registry: SimRegistry,
                  notes: list[str]) -> None:
    loop = asyncio.get_running_loop()
    pending: list[tuple[float, str, object]] = [(f.at, "on", f) for f in schedule.faults]
    pending += [(f.at + f.down_s, "off", f) for f in schedule.faults]
    pending.sort(key=lambda x: (x[0], x[1] == "on"))
    for at, phase, fault in pending:
        if at >= schedule.faults_until_s:
            continue
        if at > loop.time():
            await asyncio.sleep(at - loop.time())
        _apply(fault, phase == "on", peers, net, registry, loop.time(), notes)  # type: ignore[arg-type]
    if schedule.faults_until_s > loop.time():
        await asyncio.sleep(schedule.faults_until_s - loop.time())


def _apply(f: Fault, on: bool, peers: Sequence[SimPeer], net: SimNetwork, registry: SimRegistry, now: float,
           notes: list[str]) -> None:
    if f.kind == "leave":
        if on and f.round < 0:
            peers[f.peer].leaving = asyncio.ensure_future(peers[f.peer].leave())
        elif on:
            _leave_after_promise(f, peers, net, notes)
    elif f.kind in ("mean_crash", "push_crash"):
        if on:
            _crash_after(f, "mean" if f.kind == "mean_crash" else "push", peers, net, notes)
        elif not peers[f.peer].alive and not peers[f.peer].left:
            peers[f.peer].start()
    elif f.kind == "crash":
        peer = peers[f.peer]
        if on:
            peer.crash()
        elif not peer.alive and not peer.left:
            peer.start()
    elif f.kind == "freeze":
        if on:
            net.frozen[peers[f.peer].peer_id] = now + f.down_s
    elif f.kind == "partition":
        if on:
            sides = [[peers[i].peer_id for i in side] for side in f.sides]
            net.partition(sides)
            registry.heal()
            registry.partition(*sides)
        else:
            net.heal()
            registry.heal()
    elif f.kind == "stale":
        registry.stale, registry.stale_s = (f.rate, 10.0) if on else (0.0, 0.0)


def _crash_after(f: Fault, call: str, peers: Sequence[SimPeer], net: SimNetwork, notes: list[str]) -> None:
    victim, to = peers[f.peer], None if f.to < 0 else peers[f.to].peer_id

    def answered(caller: str, node: SimNode, tag: object) -> None:
        if (caller == to or (to is None and caller != victim.peer_id)) and node.peer_id == victim.peer_id \
                and tag == (call, f.round) and victim.alive:
            net.answered.remove(answered)
            victim.crash()
            what = "its mean" if call == "mean" else "the push"
            notes.append(f"{victim.peer_id} crashed right after serving {caller} {what} of round {f.round} at "
                         f"t={asyncio.get_running_loop().time():.2f}")

    net.answered.append(answered)


def _leave_after_promise(f: Fault, peers: Sequence[SimPeer], net: SimNetwork, notes: list[str]) -> None:
    leaver = peers[f.peer]

    def answered(caller: str, node: SimNode, tag: object) -> None:
        if node.peer_id == leaver.peer_id and tag == ("prepare", f.round) and leaver.alive:
            net.answered.remove(answered)
            notes.append(f"{leaver.peer_id} left right after promising a ballot of round {f.round} to {caller} at "
                         f"t={asyncio.get_running_loop().time():.2f}")
            leaver.leaving = asyncio.ensure_future(leaver.leave())

    net.answered.append(answered)


async def _end_faults(peers: Sequence[SimPeer], net: SimNetwork, registry: SimRegistry) -> None:
    net.heal()
    registry.heal()
    net.frozen.clear()
    net.drop = 0.0
    registry.stale = 0.0
    for p in peers:
        if not p.alive and not p.left:
            p.start()


async def _until_recovered(peers: Sequence[SimPeer], *, past: int, limit_s: float) -> float | None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < limit_s:
        if all(p.part is not None and p.part.round > past for p in peers if not p.left):
            return round(loop.time() - start, 3)
        await asyncio.sleep(0.5)
    return None


def check_safety(ledger: Ledger) -> list[str]:
    """Every round's states (committed into or adopted) are one; every commit of a round one value."""
    problems = [f"round {r} has {len(d)} states: {sorted(x[:12] for x in d)}" for r, d in sorted(ledger.states.items())
                if len(d) > 1]
    values: dict[int, set[str]] = {}
    for _, _, r, value_id, _ in ledger.commits:
        values.setdefault(r, set()).add(value_id)
    problems += [f"round {r} committed {len(v)} values" for r, v in sorted(values.items()) if len(v) > 1]
    return problems


def check_spinning(ledger: Ledger, *, peers: Sequence[str], span_s: float) -> list[str]:
    """Attempts per peer per attempt span stay bounded (a peer that retries without waiting spins)."""
    out = []
    for peer in peers:
        times = sorted(t for t, p, *_ in ledger.attempts if p == peer)
        for i in range(len(times)):
            j = i
            while j < len(times) and times[j] - times[i] < span_s:
                j += 1
            if j - i > MAX_ATTEMPTS_PER_SPAN:
                out.append(f"{peer} made {j - i} attempts within one attempt span from t={times[i]:.1f}")
                break
    return out
