"""The coordinator's control-plane duty: publish the signed run record, keep its round current, and fix each
averaging scope's genesis (the voters of its first round) once, from the first peers that serve it."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping, Sequence

from swarmtrain.config import RunConfig, public_dict
from swarmtrain.discovery.protocol import Discovery, DiscoveryError, RunConflictError
from swarmtrain.discovery.records import PeerRecord, RunRecord
from swarmtrain.round.ballots import Genesis, Voter
from swarmtrain.round.committee import committee

__all__ = ["RunPublisher", "existing_run", "next_genesis", "scope_of", "with_run_nonce"]

log = logging.getLogger(__name__)


async def existing_run(discovery: Discovery, *, timeout_s: float) -> RunRecord | None:
    """The run record already in the DHT (a restarted coordinator continues its run), None when there is none
    or several disagree."""
    try:
        return await discovery.fetch_run(timeout_s=timeout_s)
    except RunConflictError as e:
        log.warning("several run records for run %s (%s): starting it afresh", discovery.run_id, e)
        return None


async def with_run_nonce(discovery: Discovery, cfg: RunConfig, *, timeout_s: float,
                         existing: RunRecord | None = None) -> RunConfig:
    """`cfg` with its `train.run_nonce`: the configured one; else that of the run record already in the
    DHT (`existing`, read when not given); else a fresh random one (a new run)."""
    if cfg.train.run_nonce:
        return cfg
    if existing is None:
        existing = await existing_run(discovery, timeout_s=timeout_s)
    nonce = existing.run_config().train.run_nonce if existing is not None else ""
    if nonce:
        log.info("run %s continues with nonce %s from %s's run record", discovery.run_id, nonce,
                 existing.coordinator_id if existing is not None else "?")
    else:
        nonce = secrets.token_hex(8)
        log.info("run %s starts with nonce %s", discovery.run_id, nonce)
    return cfg.replace(train={"run_nonce": nonce})


def scope_of(record: PeerRecord) -> str | None:
    """The averaging scope a live record's peer votes in ("" = the whole model), None for none."""
    if record.role == "worker":
        return ""
    if record.role == "stage_server":
        return f"stage{record.stage}"
    if record.role == "trainer":
        return "ends"
    return None


def next_genesis(peers: Sequence[PeerRecord], known: Mapping[str, Genesis], *, min_peers: int, max_voters: int = 0,
                 run_nonce: str = "") -> dict[str, Genesis]:
    """`known` with a genesis for each scope that has none yet and at least `min_peers` serving peers at round 0:
    those peers (with their incarnations), at most `max_voters` of them (round/committee.py, 0 = all), are the
    voters of its round 0. Once fixed, a genesis never changes: two genesis voter sets for one round could each
    choose a value."""
    out = dict(known)
    serving: dict[str, list[PeerRecord]] = {}
    for p in peers:
        scope = scope_of(p)
        if scope is not None and p.endpoint and not p.client_mode and p.round == 0:
            serving.setdefault(scope, []).append(p)
    for scope, ps in sorted(serving.items()):
        if scope not in out and len(ps) >= min_peers:
            voters = tuple(Voter(p.peer_id, p.incarnation) for p in sorted(ps, key=lambda p: p.peer_id))
            out[scope] = Genesis(0, committee(voters, size=max_voters, seed=f"{run_nonce}/{scope}/genesis"))
            log.info("scope %r: round 0's voters are %s", scope, [str(v) for v in out[scope].voters])
    return out


class RunPublisher:
    """Publishes `cfg` as the run record, then every `heartbeat_s` sets its round to the live peers' newest and
    fixes the genesis of scopes that got their first `averaging.min_peers` serving peers.

    The config of a run never changes once published, nor does a scope's genesis (`genesis`: the one the
    run's record already had, when a coordinator restarts). The coordinator is not on the data path: if it
    dies, peers keep training and the record ages out after an hour (a scope without a genesis waits for it).
    """

    def __init__(self, discovery: Discovery, cfg: RunConfig, *, genesis: Mapping[str, Genesis] | None = None) -> None:
        if cfg.train.run_id != discovery.run_id:
            raise ValueError(f"train.run_id {cfg.train.run_id!r} is not the discovery's run {discovery.run_id!r}")
        self._d = discovery
        self._cfg = cfg
        self._interval_s = cfg.discovery.heartbeat_s
        self.genesis: dict[str, Genesis] = dict(genesis or {})
        self.record = self._record(0)

    def _record(self, round_index: int) -> RunRecord:
        return RunRecord(run_id=self._d.run_id, coordinator_id=self._d.peer_id, config=public_dict(self._cfg),
                         round=round_index, updated_at=self._d.now(), genesis=dict(self.genesis))

    async def publish(self) -> RunRecord:
        self.record = self._record(self.record.round)
        await self._d.publish_run(self.record, timeout_s=self._interval_s * 5)
        return self.record

    async def refresh(self) -> RunRecord:
        """One tick: read live peers; republish when the newest round moved (or to keep the record fresh)."""
        peers = await self._d.live_peers(timeout_s=self._interval_s * 2)
        self.genesis = next_genesis(peers, self.genesis, min_peers=self._cfg.averaging.min_peers,
                                    max_voters=self._cfg.averaging.max_voters, run_nonce=self._cfg.train.run_nonce)
        newest = max((p.round for p in peers), default=self.record.round)
        if newest != self.record.round:
            log.info("run %s: round %d -> %d (%d live peers)", self._d.run_id, self.record.round, newest, len(peers))
        self.record = self._record(max(newest, self.record.round))
        await self._d.publish_run(self.record, timeout_s=self._interval_s * 5)
        return self.record

    async def serve(self, stop: asyncio.Event) -> None:
        """Refresh every `heartbeat_s` until `stop` is set; a failed tick is logged and retried."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.refresh()
            except (DiscoveryError, TimeoutError) as e:
                log.warning("run record refresh failed: %s", e)
