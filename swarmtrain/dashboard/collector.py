"""The coordinator's view of the swarm: reads the live peer records every poll, keeps the history and says
what an operator should look at (the dashboard's API and the swarm's /metrics read it).

A peer's *sample* is taken when its record shows a round it had not reached at its previous sample (and
its stats show the commit or heal that got it there); it carries the deltas of its cumulative stats since
its previous sample (tokens, bytes, seconds), so sums over samples are the swarm's totals. Invalid records
(validate.py) are listed, never sampled. Only reads the DHT: the dashboard writes nothing there.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.config import DashboardConfig
from swarmtrain.dashboard.history import History, Sample
from swarmtrain.dashboard.validate import problems
from swarmtrain.discovery import Discovery, PeerRecord
from swarmtrain.discovery.stats import PeerStats
from swarmtrain.telemetry.tally import Histogram

__all__ = ["Collector", "part_of"]

log = logging.getLogger(__name__)


def part_of(record: PeerRecord) -> int:
    """What a peer averages: -2 the whole model (a DiLoCo worker), K a pipeline stage, -1 a pipeline's ends."""
    return record.stage if record.role == "stage_server" else -1 if record.role == "trainer" else -2


@dataclass
class _Last:
    round: int
    stats: PeerStats
    sampled_at: float
    bandwidth_bytes_per_s: float = 0.0


@dataclass
class _Seen:
    record: PeerRecord
    problems: list[str] = field(default_factory=list)


class Collector:
    def __init__(self, discovery: Discovery, history: History, cfg: DashboardConfig, *, record_ttl_s: float,
                 io_timeout_s: float, clock: Callable[[], float] = time.time) -> None:
        self.discovery = discovery
        self.history = history
        self.cfg = cfg
        self.record_ttl_s = record_ttl_s
        self.io_timeout_s = io_timeout_s
        self.clock = clock
        self.started_at = clock()
        self.polls = self.poll_errors = 0
        self.last_poll_at = 0.0
        self.live: list[_Seen] = []
        self.departed: set[str] = set()
        self.allreduce_s = Histogram()
        counts, total = history.comm_histogram(self.allreduce_s.bounds)
        self.allreduce_s.counts, self.allreduce_s.total, self.allreduce_s.n = counts, total, sum(counts)
        # Where each (peer, part) was at its newest sample: from the stored records, so a restart goes on.
        self._last: dict[tuple[str, int], _Last] = {}
        for row in history.peers():
            try:
                rec = PeerRecord.from_json(row["record"])
            except ValueError:
                continue
            if rec.stats is not None and not row["invalid"]:
                self._last[(rec.peer_id, part_of(rec))] = _Last(rec.round, rec.stats, row["last_seen"])

    async def poll(self) -> None:
        """Read the live records once; sample the peers that reached a new round."""
        try:
            peers = [p for p in await self.discovery.live_peers(timeout_s=self.io_timeout_s) if p.role != "coordinator"]
            self.departed = {d.peer_id for d in await self.discovery.departures(timeout_s=self.io_timeout_s)}
        except Exception as e:  # a slow control plane: keep the last view, say so in /api/health
            self.poll_errors += 1
            log.warning("dashboard: could not read the live peers: %s", e)
            return
        now = self.clock()
        median = int(statistics.median_low([p.round for p in peers])) if peers else 0
        seen = [_Seen(p, problems(p, median_round=median)) for p in peers]
        self.history.see([(s.record, "; ".join(s.problems)) for s in seen], at=now)
        samples: list[Sample] = []
        aborts: list[tuple[str, int, int, float, str]] = []
        for s in seen:
            rec = s.record
            if s.problems or rec.stats is None:
                continue
            key, stats = (rec.peer_id, part_of(rec)), rec.stats
            last = self._last.get(key)
            before = last.stats if last is not None else PeerStats()
            if last is not None and (stats.tokens < before.tokens or stats.rounds_aborted < before.rounds_aborted):
                before = PeerStats()  # the peer restarted: its counters began again
            # A record's round can run one beat ahead of its stats (the round line comes after the commit):
            # a new round is sampled once the stats show the commit or heal that reached it.
            caught_up = stats.rounds_committed + stats.heals > before.rounds_committed + before.heals
            if last is None or (rec.round > last.round and caught_up):
                moved = stats.bytes_sent + stats.bytes_received - before.bytes_sent - before.bytes_received
                comm = max(0.0, stats.comm_s - before.comm_s)
                samples.append(Sample(rec.peer_id, key[1], rec.round, now, rec.state_hash, stats.loss, stats.val_loss,
                                      max(0, stats.tokens - before.tokens), stats.tokens_per_s, max(0, moved),
                                      max(0.0, stats.compute_s - before.compute_s), comm, stats.spread))
                if comm > 0:  # a peer's first sample carries no round of its own
                    self.allreduce_s.observe(comm)
                bandwidth = moved / comm if comm > 0 and moved > 0 else (last.bandwidth_bytes_per_s if last else 0.0)
                self._last[key] = _Last(rec.round, stats, now, bandwidth)
            if stats.rounds_aborted > before.rounds_aborted:
                aborts.append((rec.peer_id, key[1], rec.round, now, stats.abort_reason))
                if key in self._last:
                    self._last[key].stats = stats
        self.history.add(samples, aborts)
        self.live, self.last_poll_at = seen, now
        self.polls += 1

    # -- what the API shows ---------------------------------------------------------------------------
    def peers(self) -> list[dict[str, Any]]:
        now = self.clock()
        agree = self._majorities()
        out = []
        for s in self.live:
            r, st = s.record, s.record.stats
            part = part_of(r)
            top_round, top_hash = agree.get(part, (r.round, r.state_hash))
            last = self._last.get((r.peer_id, part))
            state = "invalid" if s.problems else "behind" if r.round < top_round else \
                "disagrees" if r.round == top_round and r.state_hash != top_hash else "ok"
            busy = (st.compute_s + st.comm_s) if st else 0.0
            out.append({
                "peer_id": r.peer_id, "role": r.role, "stage": r.stage, "part": part, "endpoint": r.endpoint,
                "client_mode": r.client_mode, "round": r.round, "state_hash": r.state_hash,
                "hash_agrees": r.state_hash == top_hash if r.round == top_round else None, "state": state,
                "problems": s.problems, "heartbeat_age_s": round(max(0.0, now - r.heartbeat_at), 3),
                "clock_offset_s": r.clock_offset_s, "latency_s": r.server.latency_s if r.server else 0.0,
                "queue": r.server.queue if r.server else 0,
                "bandwidth_bytes_per_s": last.bandwidth_bytes_per_s if last and not s.problems else 0.0,
                "compute_utilization": st.compute_s / busy if st and busy > 0 and not s.problems else None,
                "stats": st.to_json() if st else None})
        return out

    def _majorities(self) -> dict[int, tuple[int, str]]:
        """Per part: its newest round among valid live peers and the hash most of them hold there."""
        by_part: dict[int, list[PeerRecord]] = collections.defaultdict(list)
        for s in self.live:
            if not s.problems:
                by_part[part_of(s.record)].append(s.record)
        out = {}
        for part, records in by_part.items():
            top = max(r.round for r in records)
            hashes = collections.Counter(r.state_hash for r in records if r.round == top)
            out[part] = (top, hashes.most_common(1)[0][0])
        return out

    def alerts(self) -> list[dict[str, Any]]:
        now = self.clock()
        out: list[dict[str, Any]] = []
        groups: dict[tuple[int, int], dict[str, list[str]]] = {}
        for s in self.live:
            if s.problems:
                out.append({"kind": "invalid_record", "peer": s.record.peer_id, "problems": s.problems})
                continue
            r = s.record
            groups.setdefault((part_of(r), r.round), {}).setdefault(r.state_hash, []).append(r.peer_id)
        for (part, round_index), hashes in sorted(groups.items()):
            if len(hashes) > 1 and round_index > 0:
                out.append({"kind": "hash_disagreement", "part": part, "round": round_index, "hashes": hashes})
        newest = self.history.newest_round_at()
        if self.live and newest is not None and now - newest > self.cfg.stuck_after_s:
            out.append({"kind": "stuck_round", "since_s": round(now - newest, 1)})
        live = {s.record.peer_id for s in self.live}
        for row in self.history.peers():
            gone_s = now - row["last_seen"]
            if row["peer_id"] not in live and row["peer_id"] not in self.departed \
                    and gone_s <= self.cfg.silent_window_s:
                out.append({"kind": "silent_peer", "peer": row["peer_id"], "last_seen_s": round(gone_s, 1)})
        return out

    def agreement(self) -> float:
        """Fraction of the valid live peers at their part's newest round that hold its majority hash (1 = all)."""
        agree, at_top = 0, 0
        majorities = self._majorities()
        for s in self.live:
            part = part_of(s.record)
            if s.problems or part not in majorities or s.record.round != majorities[part][0]:
                continue
            at_top += 1
            agree += s.record.state_hash == majorities[part][1]
        return agree / at_top if at_top else 1.0

    def status(self) -> dict[str, Any]:
        majorities = self._majorities()
        return {"run_id": self.discovery.run_id, "coordinator": self.discovery.peer_id,
                "round": max((r for r, _ in majorities.values()), default=0),
                "parts": {str(p): {"round": r, "hash": h} for p, (r, h) in sorted(majorities.items())},
                "live_peers": len(self.live), "invalid_peers": sum(1 for s in self.live if s.problems),
                "hash_agreement": self.agreement(), "alerts": self.alerts(), "peers": self.peers(),
                "polled_at": self.last_poll_at}
