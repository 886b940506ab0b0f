"""Watching the other peers: reading their live records, which also keeps this peer's clock on the swarm's
and its DHT links alive.

A mixin of `Peer` (swarmtrain/peer/root.py). Every read of the live peers goes through `_read_peers`, which
moves the clock estimate (peer/presence.py); heal checks and the waits after a round read at round
boundaries, and `_settle_clock` reads every heartbeat while the clock is off, so a joiner whose clock is
seconds off agrees with the swarm within a few heartbeats instead of a few rounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from swarmtrain.discovery import PeerRecord
from swarmtrain.driver.presence import Presence

__all__ = ["Watching"]

log = logging.getLogger(__name__)


class Watching:
    """Reads of the live peers for a `Peer`, whose discovery, config and waits it uses."""

    async def _read_peers(self, *, level: int = logging.WARNING, why: str = "") -> Sequence[PeerRecord] | None:
        """The live peer records, this peer's clock estimate corrected by them; None when the read failed
        (logged at `level`, with `why` appended: a slow control plane must not stop training)."""
        assert self.discovery is not None
        try:
            peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:
            log.log(level, "could not list live peers (%s)%s", e, why)
            return None
        self._presence().correct(self.discovery, peers)
        return peers

    async def _await_swarm_past(self, round_index: int, *, until: float, stop: asyncio.Event) -> bool:
        """After a round that did not commit here, wait until `until` (swarm clock) or the swarm passing it.

        Until then the attempt this peer missed may still commit without it: if it does, the next
        heal check adopts the swarm's state; otherwise the round is averaged again. False if `stop` was set.
        """
        await self._watch_peers(lambda peers: any(p.round > round_index for p in peers),
                                deadline=time.monotonic() + until - self._now(), stop=stop)
        return not stop.is_set()

    async def _watch_peers(self, done: Callable[[Sequence[PeerRecord]], bool], *, deadline: float,
                           stop: asyncio.Event) -> None:
        """Poll the other live peers every half heartbeat until `done(peers)`, `deadline` (monotonic) or `stop`.

        A failed read counts as seeing nobody (logged); the next poll tries again.
        """
        while time.monotonic() < deadline and not stop.is_set():
            peers = await self._read_peers() or ()
            await self._rejoin_dht_if_isolated()
            if done([p for p in peers if p.peer_id != self._peer_id]):
                return
            await self._wait_until(min(deadline, time.monotonic() + self.cfg.discovery.heartbeat_s / 2), stop)

    async def _settle_clock(self) -> None:
        """Until this peer's clock agrees with the swarm's, read the live peers every heartbeat.

        Round boundaries read them too (heal checks, waits), but rounds can be minutes apart: a joiner whose
        clock is seconds off would halve its error once per round and miss windows meanwhile. Once settled,
        the boundary reads keep watch, and a read that finds the clock off again resumes this one.
        """
        while True:
            await asyncio.sleep(self.cfg.discovery.heartbeat_s)
            if not self._presence().settled:  # a failed read: the next heartbeat tries again
                await self._read_peers(level=logging.DEBUG, why=" to check the clock")

    async def _rejoin_dht_if_isolated(self) -> None:
        """After two record TTLs without seeing another peer, dial the initial peers again (one log line).

        A DHT node bootstraps once; one whose links all dropped would otherwise wait alone for good."""
        assert self.discovery is not None
        maddrs = self.cfg.discovery.initial_peers
        if not maddrs or not self._presence().rebootstrap_due():
            return
        try:
            answered = await self.discovery.rebootstrap(maddrs, timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:  # the next due time tries again
            log.warning("no other live peer seen for %.0f s; re-joining the DHT through %d initial peer(s) failed: "
                        "%s", self._presence().unseen_s(), len(maddrs), e)
            return
        log.warning("no other live peer seen for %.0f s: re-joined the DHT through its initial peers (%d of %d "
                    "answered)", self._presence().unseen_s(), answered, len(maddrs))

    def _presence(self) -> Presence:
        if self.presence is None:
            self.presence = Presence(self.cfg.discovery, run_id=self.cfg.train.run_id)
        return self.presence
