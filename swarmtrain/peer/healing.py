"""Healing: a peer behind the swarm (or holding another θ_global than its group) adopts a live peer's state.

A mixin of `Peer` (swarmtrain/peer/root.py), which owns the state it changes; the decision (whom to
ask, what is kept) is round/heal.py's, and when to look is the round machine's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from swarmtrain.diloco.flat import flat_hash
from swarmtrain.round import Heal, RoundMachine, keeps_progress, plan_heal
from swarmtrain.telemetry import HealEvent

__all__ = ["Healing"]

log = logging.getLogger(__name__)


class Healing:
    """State transfer into a running peer; mixed into `Peer`, whose attributes and steps it uses."""

    async def _heal(self, machine: RoundMachine, action: Heal) -> bool:
        """Perform the machine's heal check and report it; True when a donor's state was adopted."""
        donor = await self._heal_if_behind(keep_progress_rounds=action.keep_progress_rounds,
                                           want_hash=action.want_hash)
        assert self.worker is not None
        if donor is None:
            machine.healed(round_index=None)
            return False
        machine.healed(round_index=self.worker.round, source=donor, kept_progress=self.worker.has_local_progress())
        return True

    async def _heal_if_behind(self, *, keep_progress_rounds: int = 0, want_hash: str = "") -> str | None:
        """If live peers are at a newer round, download their state and join at the next boundary.

        Returns the donor's peer id, or None when nothing was adopted. The decision is
        round/heal.py's: whom to ask, and whether θ_local's unsent steps are kept (overlap mode, at
        most `keep_progress_rounds` late). With `want_hash` (this peer was left out of a group for its
        θ_global), peers at this peer's round that announce that hash are donors too, and what they
        serve must hash to it.
        """
        assert self.discovery is not None and self.worker is not None and self.plane is not None
        peers = await self._read_peers(why="; not healing this round")  # the next round looks again
        if peers is None:
            return None
        await self._rejoin_dht_if_isolated()
        own = self.worker.round
        plan = plan_heal(peers, own_round=own, self_id=self._peer_id, want_hash=want_hash,
                         min_support=self.cfg.averaging.min_peers)
        if plan is None:
            return None
        if not plan.donors:
            log.warning("behind the swarm but not healing this round: %s", plan.problem)
            return None
        self.phase = "healing"
        from_round = self.worker.round
        # A range from each of several donors at once first (they must serve one blob); then one at a time.
        width = min(self.cfg.rpc.state_donors, len(plan.donors))
        tries = ([plan.donors[:width]] if width > 1 else []) + [[d] for d in plan.donors]
        for donors in tries:
            start = time.perf_counter()
            names = ", ".join(d.peer_id for d in donors)
            try:
                state, served = await self.plane.fetch_state([d.endpoint for d in donors])
            except Exception as e:
                log.warning("state download from %s failed: %s", names, e)
                continue
            source = ",".join(d.peer_id for d in donors if d.endpoint in served)
            if state.round != plan.round:
                log.info("%s served round %d, not the swarm's round %d (moved on): next donor", source, state.round,
                         plan.round)
                continue
            served_hash = await asyncio.to_thread(flat_hash, state.theta_global)
            if served_hash != plan.state_hash:
                log.warning("%s served round %d with θ_global %s, not the %s the swarm announces: refused", source,
                            state.round, served_hash[:12], plan.state_hash[:12])
                continue
            keep = keeps_progress(own_round=own, donor_round=state.round, keep_progress_rounds=keep_progress_rounds,
                                  want_hash=want_hash)
            await asyncio.to_thread(functools.partial(
                self.worker.adopt_global, round_index=state.round, theta_global=state.theta_global,
                outer_momentum=state.outer_momentum, keep_progress=keep, members=state.members))
            if not keep:
                self.worker.forget_residual()
            ends = plan.round_ends_at if state.round == plan.round else None
            self._round_ends_at = ends or 0.0
            self._join_by = None if ends is None else (state.round, time.monotonic() + ends - self._now())
            await self._publish_committed_state()
            self.writer.emit(HealEvent(from_round=from_round, to_round=state.round, source=source,
                                       hash=self.worker.global_hash(), peer=self._peer_id,
                                       transfer_s=round(time.perf_counter() - start, 4)))
            self.phase = "training"
            # No checkpoint here: it would delay joining the round the others are starting now; the
            # next commit checkpoints, and a crash before it just heals again.
            self._beat_soon()
            assert self._beat_task is not None
            await self._beat_task
            return source
        self.phase = "training"
        log.warning("behind the swarm (round %d < %d) but no donor delivered its state %s", self.worker.round,
                    plan.round, plan.state_hash[:12])
        return None
