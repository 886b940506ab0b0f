"""The simulator at a swarm's size: N peers on links of stated latency, with churn, running the production round
code on virtual time; what share of rounds commit, and how long a round takes outside compute.

Every peer has an access link whose one-way delay is drawn from `access_ms` (uniform): a call between peers i and
j takes access_i + access_j each way, so with the default 5-50 ms per access link a round trip takes 20-200 ms.
A DHT operation takes `dht_rtts` mean round trips (Kademlia's iterative lookup: about log(N)/3 hops of
alpha-parallel queries). Links have no rate limit: the simulation's Δ is a few thousand values, and bytes are
what the testbed measures. Churn: every live peer crashes with probability `churn` per `train_s` of virtual
time (its process gone, its disk kept), at any moment: each virtual second with probability churn / train_s
per second, so that crashes land in every phase of a round as they would among independent machines, not all
at one instant; it restarts `down_s` later from its checkpoint. Each
peer's record announces when its inner steps end, and a peer healed into a round under way ends its steps
with the swarm's, as a worker does.

Measured from the ledger (every attempt, commit and heal of every peer): the rounds the swarm committed, the
share of peers' round attempts that committed (an attempt that ended without a commit is a matchmaking attempt,
an all-reduce or a decision that failed), the share of rounds that every peer present committed at its first
attempt, and each round's length outside compute (from its first commit anywhere to the next, minus `train_s`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from swarmtrain.config import RunConfig
from swarmtrain.testing.sim.dht import SimRegistry
from swarmtrain.testing.sim.loop import SimDeadlock, VirtualLoop, run_virtual
from swarmtrain.testing.sim.network import SimNetwork
from swarmtrain.testing.sim.part import Ledger
from swarmtrain.testing.sim.peer import SimPeer
from swarmtrain.testing.sim.run import check_safety, fast_tmp, sim_config, start_coordinator

__all__ = ["ScaleResult", "ScaleRun", "run_scale", "scale_config"]

# The simulation tester's run, with windows for internet round trips of up to 200 ms and DHT operations of
# several of them.
SCALE_TIMING = (
    "averaging.matchmaking_timeout_s=5.0", "averaging.allreduce_timeout_s=20.0",
    "averaging.contribution_window_s=3.0", "averaging.max_retries=3", "discovery.heartbeat_s=2.0",
    "discovery.record_ttl_s=30.0", "rpc.call_timeout_s=4.0",
)


def scale_config(*extra: str) -> RunConfig:
    return sim_config(*SCALE_TIMING, *extra)


@dataclass(frozen=True)
class ScaleRun:
    """One simulated swarm: `peers` peers for `rounds` rounds' worth of virtual time (see the module docstring)."""

    peers: int
    rounds: int = 20
    seed: int = 0
    access_ms: tuple[float, float] = (5.0, 50.0)
    churn: float = 0.01  # probability per live peer per round (`train_s`) of a crash
    tick_s: float = 1.0  # how often the crashes are drawn (virtual seconds)
    down_s: tuple[float, float] = (5.0, 30.0)
    train_s: float = 10.0  # a round's inner steps, virtual seconds
    numel: int = 0  # Δ's size; 0: 64 values per peer (every reducer has a shard)
    max_skew_s: float = 2.0
    extra: tuple[str, ...] = ()  # more config overrides

    @property
    def dht_rtts(self) -> float:
        return max(1.0, math.log2(max(2, self.peers)) / 3)


@dataclass
class ScaleResult:
    run: ScaleRun
    virtual_s: float = 0.0
    rounds: int = 0  # rounds committed by the swarm
    attempts: int = 0  # peers' round attempts
    attempts_committed: int = 0
    rounds_first_try: int = 0  # rounds that every peer present at its first attempt committed at that attempt
    outside_s: list[float] = field(default_factory=list)  # per round: its length outside compute
    crashes: int = 0
    abort_reasons: dict[str, int] = field(default_factory=dict)
    safety: list[str] = field(default_factory=list)
    calls: int = 0  # simulated data-plane calls
    dht_ops: int = 0

    @property
    def commit_rate(self) -> float:
        return self.attempts_committed / self.attempts if self.attempts else float("nan")

    @property
    def first_try_rate(self) -> float:
        return self.rounds_first_try / self.rounds if self.rounds else float("nan")

    def summary(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("run", "outside_s")}
        out.update(peers=self.run.peers, commit_rate=self.commit_rate, first_try_rate=self.first_try_rate,
                   outside_s_median=statistics.median(self.outside_s) if self.outside_s else None,
                   outside_s_p90=_quantile(self.outside_s, 0.9))
        return out


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_scale(run: ScaleRun) -> ScaleResult:
    """Run `run` on a fresh virtual loop and measure it (see the module docstring)."""
    random.seed(run.seed)
    with tempfile.TemporaryDirectory(prefix="swarmtrain-sim-scale-", dir=fast_tmp()) as tmp:
        return run_virtual(lambda: _run(run, Path(tmp)))


async def _run(run: ScaleRun, root: Path) -> ScaleResult:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    cfg = scale_config(*run.extra)
    rng = random.Random(run.seed * 7919 + 1)
    ids = [f"p{i:02d}" for i in range(run.peers)]
    access = {p: rng.uniform(*run.access_ms) / 1000 for p in ids}
    mean_rtt_s = 4 * sum(access.values()) / len(access)  # a round trip crosses two access links twice
    registry = SimRegistry(clock=loop.clock.wall, rng=random.Random(run.seed * 31 + 7), key_seed=b"sim-keys")
    net = SimNetwork(rng=rng, access_s=access)
    ledger = Ledger()
    result = ScaleResult(run)
    stop, publishing = await start_coordinator(registry, cfg)
    numel = run.numel or 64 * run.peers
    peers = [SimPeer(index=i, cfg=cfg, net=net, registry=registry, ledger=ledger, directory=root / f"p{i:04d}",
                     skew_s=round(rng.uniform(-run.max_skew_s, run.max_skew_s), 3), seed=run.seed, numel=numel,
                     train_s=run.train_s, checkpoint_every=1, dht_latency_s=run.dht_rtts * mean_rtt_s)
             for i in range(run.peers)]
    for p in peers:
        p.start()
    horizon_s = run.rounds * (run.train_s + 10.0)  # the virtual time the run is given
    restarts: list[tuple[float, SimPeer]] = []
    try:
        per_tick = run.churn * run.tick_s / run.train_s
        while loop.time() < horizon_s:
            await asyncio.sleep(run.tick_s)
            now = loop.time()
            for at, p in [r for r in restarts if r[0] <= now]:
                restarts.remove((at, p))
                if not p.alive:
                    p.start()
            for p in peers:
                if p.alive and rng.random() < per_tick:
                    p.crash()
                    result.crashes += 1
                    restarts.append((now + rng.uniform(*run.down_s), p))
    except SimDeadlock as e:
        result.safety.append(f"deadlock: {e}")
    finally:
        stop.set()
        for p in peers:
            if p.alive:
                p.crash()
        publishing.cancel()
    result.virtual_s = loop.time()
    result.calls = net.calls
    result.dht_ops = sum(p.discovery.io.reads + p.discovery.io.writes for p in peers if p.discovery is not None)
    result.safety += check_safety(ledger)
    _measure(ledger, run, result)
    return result


def _measure(ledger: Ledger, run: ScaleRun, result: ScaleResult) -> None:
    result.attempts = len(ledger.attempts)
    result.attempts_committed = sum(1 for a in ledger.attempts if a[3])
    for _, _, _, committed, why in ledger.attempts:
        if not committed:
            key = _reason_kind(why)
            result.abort_reasons[key] = result.abort_reasons.get(key, 0) + 1
    first_commit: dict[int, float] = {}
    for t, _, r, _, _ in ledger.commits:
        first_commit[r] = min(t, first_commit.get(r, t))
    rounds = sorted(first_commit)
    result.rounds = len(rounds)
    result.outside_s = [max(0.0, first_commit[b] - first_commit[a] - run.train_s)
                        for a, b in itertools.pairwise(rounds) if b == a + 1]
    by_round: dict[int, list[bool]] = {}
    seen: set[tuple[str, int]] = set()
    for _, peer, r, committed, _ in sorted(ledger.attempts):
        if (peer, r) in seen:
            continue  # the peer's first attempt at r only
        seen.add((peer, r))
        by_round.setdefault(r, []).append(committed)
    result.rounds_first_try = sum(1 for r in rounds if r in by_round and all(by_round[r]))


def _reason_kind(why: str) -> str:
    """An abort reason without its peer ids and numbers, so that like reasons count together."""
    words = [w for w in why.replace("(", " ").replace(")", " ").replace(",", " ").split()
             if not any(c.isdigit() for c in w) and not w.startswith(("'", "[", "Qm", "p0"))]
    return " ".join(words[:8]) or "?"
