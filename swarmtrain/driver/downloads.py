"""Downloading a committed state a heal planned (driver/loop.py `RoundDriver.heal`): from the donors that announce
it, checked against the round and digest the plan names, and adopted into the part.

A plan is made from the live records as last read. A donor that serves a round past the plan's means the swarm
committed on since: every other donor of the plan would serve the newer state too, each a whole download to be
refused. So the records are read again and the heal planned again (at most REPLANS times), and a state in hand
that the new plan names (its round and digest: the digest checks the bytes) is adopted without downloading it
again. A donor whose newer round the new records do not bear out (the plan did not move) is not asked again in
that heal check, nor is one that served another state for the planned round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence

from swarmtrain.config import RunConfig
from swarmtrain.discovery import PeerRecord
from swarmtrain.driver.part import CommittedState, Part, RoundPlane
from swarmtrain.round import keeps_progress, plan_heal
from swarmtrain.round.heal import HealPlan, PeerView
from swarmtrain.round.messages import Contact
from swarmtrain.telemetry import HealEvent

__all__ = ["KEPT_CERTIFICATES", "REPLANS", "Newer", "StateDownloads"]

log = logging.getLogger(__name__)

KEPT_CERTIFICATES = 16  # a healed peer asks its donor for this many rounds' certificates
REPLANS = 2  # heals by the majority's state planned again in one heal check after the swarm moved past the plan


@dataclasses.dataclass(frozen=True)
class Newer:
    """A state a donor served for a round past the one planned: the swarm committed on while this peer healed."""

    state: CommittedState
    donors: tuple[PeerView, ...]
    source: str
    transfer_s: float


class StateDownloads:
    """A part's state downloads (see the module docstring). `peers()` are the live records as last read,
    `reread()` reads them again (False when the read failed), `adopted(event)` runs once a state is adopted."""

    def __init__(self, *, part: Part, plane: RoundPlane, cfg: RunConfig, role: str, self_id: str,
                 peers: Callable[[], Sequence[PeerRecord]], reread: Callable[[], Awaitable[bool]],
                 adopted: Callable[[HealEvent], None]) -> None:
        self.part, self.plane, self.cfg, self.role, self.self_id = part, plane, cfg, role, self_id
        self.peers, self.reread, self.adopted = peers, reread, adopted

    def _plan(self, want_hash: str) -> HealPlan | None:
        return plan_heal(self.peers(), own_round=self.part.round, self_id=self.self_id, want_hash=want_hash,
                         min_support=self.cfg.averaging.min_peers, role=self.role)

    async def majority(self, *, want_hash: str, keep: int, held: Newer | None) -> str:
        """The state a strict majority of the serving peers ahead announce (round/heal.py `plan_heal`), from its
        donors, planned again while the swarm commits past the plan; the source, or "". `held`: a newer state
        already in hand (a chain target's donor served it)."""
        refused: set[str] = set()
        plan = self._plan(want_hash)
        for replan in range(REPLANS + 1):
            if plan is None:
                return ""
            if held is not None and (held.state.round, held.state.digest) == (plan.round, plan.state_hash):
                return await self.adopt(held.state, held.donors, held.source, keep_progress_rounds=keep,
                                        want_hash=want_hash, transfer_s=held.transfer_s)
            donors = [d for d in plan.donors if d.peer_id not in refused]
            if not donors:
                log.warning("behind the swarm but not healing this round: %s", plan.problem or
                            f"every peer announcing round {plan.round}'s state {plan.state_hash[:12]} was refused")
                return ""
            got = await self.transfer(plan.round, plan.state_hash, donors, keep_progress_rounds=keep,
                                      want_hash=want_hash, refused=refused)
            if not isinstance(got, Newer):
                return got
            if replan == REPLANS:
                break
            log.info("%s served round %d, past the planned round %d: the swarm committed on; reading the live "
                     "peers again", got.source, got.state.round, plan.round)
            if not await self.reread():
                return ""
            again = self._plan(want_hash)
            if again is not None and (again.round, again.state_hash) == (plan.round, plan.state_hash):
                refused.update(d.peer_id for d in got.donors)  # its newer round is not the swarm's
            plan, held = again, got
        log.warning("behind the swarm (round %d) but it committed past every plan of this heal check; the next "
                    "check plans again", self.part.round)
        return ""

    async def transfer(self, round_index: int, digest: str, donors: Sequence[PeerView], *,
                       keep_progress_rounds: int = 0, want_hash: str = "",
                       refused: set[str] | None = None) -> str | Newer:
        """Download `round_index`'s state (digest `digest`) from the first donors that deliver; the source, or
        the first state served for a later round (the plan is behind the swarm: `majority`). An overlapped part
        at most `keep_progress_rounds` late keeps its unsent steps (round/heal.py). Donors that serve another
        state for `round_index` join `refused`."""
        loop = asyncio.get_running_loop()
        width = min(self.cfg.rpc.state_donors, len(donors))
        tries = ([list(donors[:width])] if width > 1 else []) + [[d] for d in donors]
        for group in tries:
            started = loop.time()
            names = ",".join(d.peer_id for d in group)
            try:
                state, served = await self.plane.fetch_state([d.endpoint for d in group])
            except Exception as e:  # a dead donor, a refusal, a state that does not check out: the next one
                log.warning("state download from %s failed: %s", names, e)
                continue
            source = ",".join(d.peer_id for d in group if d.endpoint in served)
            if state.round > round_index:
                return Newer(state=state, donors=tuple(group), source=source,
                             transfer_s=round(loop.time() - started, 4))
            if state.round != round_index or state.digest != digest:
                log.warning("%s served round %d with digest %s, not round %d with the %s the swarm announces: "
                            "refused", source, state.round, state.digest[:12], round_index, digest[:12])
                if refused is not None:
                    refused.update(d.peer_id for d in group if d.endpoint in served)
                continue
            return await self.adopt(state, tuple(group), source, keep_progress_rounds=keep_progress_rounds,
                                    want_hash=want_hash, transfer_s=round(loop.time() - started, 4))
        log.warning("behind the swarm (round %d < %d) but no donor delivered the state %s", self.part.round,
                    round_index, digest[:12])
        return ""

    async def adopt(self, state: CommittedState, donors: Sequence[PeerView], source: str, *,
                    keep_progress_rounds: int, want_hash: str, transfer_s: float) -> str:
        """Adopt a downloaded state whose round and digest a plan named; the source."""
        before = self.part.round
        keep = keeps_progress(own_round=before, donor_round=state.round, keep_progress_rounds=keep_progress_rounds,
                              want_hash=want_hash) and keep_progress_rounds > 0
        certificates = state.certificates or await self.plane.certificates(
            Contact(donors[0].peer_id, donors[0].endpoint), from_round=max(0, state.round - KEPT_CERTIFICATES))
        await self.part.adopt(dataclasses.replace(state, certificates=tuple(certificates)), keep_progress=keep)
        await self.plane.advanced(self.part.round, keep_from=self.part.replay_from())
        for cert in certificates:
            await self.plane.keep_certificate(cert)
        self.adopted(HealEvent(from_round=before, to_round=state.round, source=source, hash=state.digest,
                               peer=self.self_id, transfer_s=transfer_s))
        return source
