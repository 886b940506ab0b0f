"""The DiLoCo worker role, the peer daemon's composition root: discovery -> run config -> worker -> data plane ->
round driver, and the start and stop order around them.

Start: DHT node -> the run config from the coordinator's record -> worker (model, data, resume from
checkpoint) -> gRPC server (all-reduce, the round's decision, state transfer) -> heartbeat -> READY. The
rounds are the round driver's (driver/loop.py) with the worker as its part (peer/part.py); with
`diloco.overlap` the average runs during the next round's inner steps (peer/overlap.py). Stop (a signal via
process.py, rounds done or an error): the voter retires and the departure is announced, the peer record
withdrawn, a checkpoint written, the data plane drained and closed, the DHT stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmtrain.compress import codec_from_config
from swarmtrain.config import RunConfig
from swarmtrain.diloco import DilocoWorker, resolve_device
from swarmtrain.diloco.flat import param_shapes
from swarmtrain.diloco.island import Island, IslandLost
from swarmtrain.diloco.island_steps import PING_S, IslandWorker
from swarmtrain.diloco.pace import Pace
from swarmtrain.diloco.worker import InnerStep, resolve_round_device
from swarmtrain.discovery import Discovery, Heartbeat, PeerRecord
from swarmtrain.driver.gossip import KEEP_ROUNDS, GossipDriver
from swarmtrain.driver.loop import (
    RoundDriver,
    announce_departure,
    announce_stored_retirements,
    departure_record,
)
from swarmtrain.driver.presence import Presence
from swarmtrain.peer.building import build_worker, load_checkpoint, resume
from swarmtrain.peer.data import choose_shard, peer_seed, saved_slot
from swarmtrain.peer.joining import GenesisReader
from swarmtrain.peer.memory import check_worker_budget
from swarmtrain.peer.network import NetworkPlane
from swarmtrain.peer.overlap import run_overlapped
from swarmtrain.peer.part import WorkerPart
from swarmtrain.peer.services import PeerError, PeerServices
from swarmtrain.roles.base import RoleBase
from swarmtrain.round.group import Member
from swarmtrain.rpc.gossip_wire import GossipMailbox, serve_gossip
from swarmtrain.rpc.node import RpcNode
from swarmtrain.telemetry import EventWriter, LeaveEvent, StatusSnapshot
from swarmtrain.trust.identity import verifier

__all__ = ["Peer", "PeerParts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerParts:
    """A started peer: every part built, none missing (`Peer.start` builds them in this order)."""

    discovery: Discovery
    worker: DilocoWorker
    plane: NetworkPlane
    presence: Presence
    part: WorkerPart
    driver: RoundDriver
    heartbeat: Heartbeat
    gossip: GossipDriver | None  # averaging.mode = "gossip": the rounds are its, not the driver's


class Peer(RoleBase):
    """One DiLoCo peer of a swarm (the role "worker"). `await start()`, `await run(stop)`, `await aclose(reason)`.

    `start` builds the peer's parts (`parts`, a PeerParts, once all are up); what it opens on the way (the
    directory claim, the DHT, the data plane, the island's keepalive) is closed on leaving in the reverse
    order, also when a start fails half-way. `on_step` sees every inner step, on the training thread (the
    console progress display)."""

    role = "worker"

    def __init__(self, local: RunConfig, *, writer: EventWriter, services: PeerServices,
                 local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                 on_step: Callable[[InnerStep], None] | None = None, island: Island | None = None) -> None:
        """`island`: this process is rank 0 of a local island (peer/island.py); its worker leads the others."""
        super().__init__(local, writer=writer, services=services, local_overrides=local_overrides,
                         coordinator_id=coordinator_id)
        self.island = island
        self._island_lost = asyncio.Event()  # a rank of the island died or hung while this one was not training
        self._island_error = ""
        self.on_step = on_step
        self.parts: PeerParts | None = None
        self.pace = Pace(local.diloco)
        self.val_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.endpoint = ""
        self.phase = "starting"
        self._beat_task: asyncio.Task[None] | None = None
        self._departure: asyncio.Future[bool] | None = None  # retirements of an earlier run, being announced
        self._reason = ""  # why it leaves (the leave line, the island's ranks)
        self._left_with: Path | None = None  # the checkpoint written on leaving

    # The parts, None before `start` has built them all (the status snapshot, tests, benchmarks).
    @property
    def discovery(self) -> Discovery | None:
        return self.parts.discovery if self.parts else None

    @property
    def worker(self) -> DilocoWorker | None:
        return self.parts.worker if self.parts else None

    @property
    def plane(self) -> NetworkPlane | None:
        return self.parts.plane if self.parts else None

    @property
    def part(self) -> WorkerPart | None:
        return self.parts.part if self.parts else None

    @property
    def driver(self) -> RoundDriver | None:
        return self.parts.driver if self.parts else None

    @property
    def presence(self) -> Presence | None:
        return self.parts.presence if self.parts else None

    @property
    def gossip(self) -> GossipDriver | None:
        return self.parts.gossip if self.parts else None

    def _started(self) -> PeerParts:
        if self.parts is None:
            raise PeerError("the peer has not started (await start() first)")
        return self.parts

    # ------------------------------------------------------------------ start

    async def start(self) -> dict[str, Any]:
        """Bring every service up in order; returns the READY payload (also printed)."""
        opened = self._opened
        opened.push_async_callback(self._stop_island)  # told to stop even when no setup reached them
        # Resolved against this peer's own files: a model or tokenizer that differs from the run's is refused
        discovery, record = await self._join()
        check_worker_budget(self.cfg)
        loaded = load_checkpoint(self.cfg)
        self.cfg = await choose_shard(self.cfg, discovery, saved=saved_slot(
            loaded.meta.get("worker") if loaded else None, num_shards=self.cfg.data.num_shards))
        self.pace = Pace(self.cfg.diloco)
        ranks = self.island.world_size if self.island is not None else 1
        self.tally.tokens_per_step = self.cfg.data.batch_size * self.cfg.data.seq_len * ranks
        trains_on = self.island.device if self.island is not None else resolve_device(self.cfg.train.device)
        codec = codec_from_config(self.cfg.compress, seed=peer_seed(self.cfg.train.seed + 2, discovery.peer_id),
                                  device=resolve_round_device(self.cfg.train.round_device, trains_on))
        built = await asyncio.to_thread(build_worker, self.cfg, peer_id=discovery.peer_id, codec=codec,
                                        island=self.island, on_step=self.on_step)
        worker, self.val_batches = built.worker, built.val_batches
        certificates = resume(worker, loaded) if loaded is not None else []
        # Only now: a peer leaves with a leave line of its worker (and, once its part is up, a checkpoint), and
        # one whose checkpoint did not load must not write a fresh state over the run's newest.
        opened.push_async_callback(self._leave_line, worker)  # after the data plane closed: its bytes are final
        if isinstance(worker, IslandWorker):
            keepalive = asyncio.ensure_future(self._keep_island(worker))
            opened.callback(keepalive.cancel)
        gossip = self.cfg.averaging.mode == "gossip"
        mailboxes: list[GossipMailbox] = []
        plane = await self.services.open_data_plane(self.cfg, discovery=discovery, codec=codec,
                                                    param_shapes=param_shapes(worker.model), scope="",
                                                    role="worker", round_now=lambda: worker.round,
                                                    before_start=functools.partial(self._serve_gossip, mailboxes)
                                                    if gossip else None)
        opened.push_async_callback(plane.aclose)  # drains first: serves the means its group still needs
        self.endpoint = plane.endpoint

        def member(round_index: int, steps_per_s: float) -> Member:
            return Member(peer_id=discovery.peer_id, endpoint=self.endpoint,
                          client_mode=self.cfg.discovery.client_mode, steps_per_s=steps_per_s, lag_s=self.pace.lag_s,
                          state_hash=worker.digest(), incarnation=plane.incarnation)

        presence = Presence(self.cfg.discovery, run_id=self.cfg.train.run_id, clock=asyncio.get_running_loop().time)
        part = WorkerPart(self.cfg, worker=worker, writer=self.writer, pace=self.pace, val_batches=self.val_batches,
                          peer_id=lambda: discovery.peer_id, member=member, prematch=plane.prematch,
                          announce=self._beat_soon, now=discovery.now, alone_s=presence.alone_s,
                          certificates=certificates, resumed_at=worker.round if loaded is not None else None,
                          val_bytes_per_token=built.val_bytes_per_token, io=lambda: discovery.io)
        plane.attach(part.outcome_of)
        plane.serve_state(part.committed)
        for cert in certificates:  # resumed with the checkpoint: learners and peers behind are shown them again
            await plane.keep_certificate(cert)
        run = f"{self.cfg.train.run_id}/{self.cfg.train.run_nonce}"
        genesis = GenesisReader(discovery, coordinator_id=record.coordinator_id, scope="",
                                timeout_s=self.cfg.rpc.call_timeout_s)
        driver = RoundDriver(part=part, plane=plane, discovery=discovery, cfg=self.cfg, role="worker",
                             member=lambda trained: member(trained.round, trained.steps_per_s), run=run,
                             verify=verifier(discovery.key_binding), presence=presence, genesis=genesis,
                             emit=self.writer.emit, changed=self._beat_soon, overlap=self.cfg.diloco.overlap)
        gossiper = None
        if gossip:
            gossiper = GossipDriver(part=part, cfg=self.cfg, codec=codec, node=plane.node, mailbox=mailboxes[0],
                                    discovery=discovery, fetch_state=plane.fetch_state, emit=self.writer.emit,
                                    changed=self._beat_soon)
        heartbeat = Heartbeat(discovery, current=self._record, heartbeat_s=self.cfg.discovery.heartbeat_s,
                              now=discovery.now, timeout_s=self.cfg.rpc.call_timeout_s)
        self.parts = PeerParts(discovery=discovery, worker=worker, plane=plane, presence=presence, part=part,
                               driver=driver, heartbeat=heartbeat, gossip=gossiper)
        await heartbeat.start()
        if gossiper is None:  # a leave killed between storing its retirement and announcing it: announced now
            self._departure = asyncio.ensure_future(announce_stored_retirements(
                discovery, {"": plane.retirements()}, cfg=self.cfg))
        info = {"peer_id": discovery.peer_id, "endpoint": self.endpoint, "run_id": self.cfg.train.run_id,
                "maddrs": await self.services.visible_maddrs(discovery), "round": worker.round,
                "hash": worker.digest(), "num_params": worker.numel,
                **({"metrics": self.metrics} if self.metrics else {})}
        self.writer.ready(info)
        self.phase = "training"
        return info

    def _serve_gossip(self, mailboxes: list[GossipMailbox], node: RpcNode) -> None:
        mailbox = GossipMailbox(node, run_id=self.cfg.train.run_id, keep=KEEP_ROUNDS)
        serve_gossip(node, mailbox)
        mailboxes.append(mailbox)

    async def _keep_island(self, worker: IslandWorker) -> None:
        """Between rounds, ping the island's other ranks; a rank found gone ends this peer's run (`run`)."""
        while True:
            await asyncio.sleep(PING_S / 2)
            try:
                await asyncio.to_thread(worker.keepalive)
            except IslandLost as e:
                self._island_error = str(e)
                self._island_lost.set()
                return

    def _record(self) -> PeerRecord:
        parts = self._started()
        round_index, digest = parts.part.announced
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self._peer_id,
                          endpoint="" if self.cfg.discovery.client_mode else self.endpoint, role="worker",
                          client_mode=self.cfg.discovery.client_mode, round=round_index, state_hash=digest,
                          shard_index=self.cfg.data.shard_index, round_ends_at=parts.part.round_ends_at,
                          clock_offset_s=parts.presence.clock_offset_s, stats=self.tally.stats(),
                          incarnation=parts.plane.incarnation)

    def _beat_soon(self) -> None:
        """Publish the peer record in the background: a DHT store (~0.1 s) must not hold up the next round."""
        previous = self._beat_task

        async def beat() -> None:
            if previous is not None:
                await previous  # records land in the order they were made
            if self.parts is None:
                return
            try:
                await self.parts.heartbeat.beat()
            except Exception as e:  # the periodic beat retries; a failed early beat only delays visibility
                log.warning("peer record refresh failed: %s", e)

        self._beat_task = asyncio.ensure_future(beat())

    # ------------------------------------------------------------------ rounds

    async def run(self, stop: asyncio.Event) -> str:
        """Train until `diloco.rounds` rounds are committed or `stop` is set; returns why it ended. On an island,
        a rank found gone while this one was not training ends the rounds at their next boundary and raises
        IslandLost (one found gone during an inner step raises it from there)."""
        if self.island is None:
            return await self._rounds(stop)
        rounds = asyncio.ensure_future(self._rounds(stop))
        lost = asyncio.ensure_future(self._island_lost.wait())
        done, _ = await asyncio.wait({rounds, lost}, return_when=asyncio.FIRST_COMPLETED)
        if rounds in done:
            lost.cancel()
            return rounds.result()
        stop.set()
        with contextlib.suppress(Exception):
            await rounds
        raise IslandLost(self._island_error)

    async def _rounds(self, stop: asyncio.Event) -> str:
        parts = self._started()
        if parts.gossip is not None:
            return await parts.gossip.run(stop)
        if self.cfg.diloco.overlap:
            return await run_overlapped(parts.driver, parts.part, stop)
        return await parts.driver.run(stop)

    # ------------------------------------------------------------------ stop

    async def aclose(self, reason: str) -> None:
        """Leave: the voter retires (stored, then announced), the record is withdrawn, a checkpoint written; then
        what start opened closes in reverse: the data plane drained and closed (the leave line), the island's
        ranks told to stop, the DHT stopped, the directory released, whatever fails before (a process whose DHT
        child outlives it never exits: multiprocessing joins it)."""
        self.phase, self._reason = "leaving", reason
        try:
            if self.parts is not None:
                await self._leave(self.parts)
        finally:
            await self._opened.aclose()
            self.phase = "stopped"

    async def _leave(self, parts: PeerParts) -> None:
        if parts.gossip is None:
            with contextlib.suppress(Exception):  # best effort: retiring below is what must happen
                await parts.driver.hand_over()  # its record stays up meanwhile: proposers find its voter
        if self._beat_task is not None:
            await self._beat_task  # a record stored after the withdrawal would announce a departed peer
        await parts.heartbeat.aclose(withdraw=True)
        if self._departure is not None:
            self._departure.cancel()  # the record below names those retirements too, and it must be the last
        if parts.gossip is None:
            await self._announce_departure(parts)  # gossip has no voters to retire
        try:
            self._left_with = await parts.part.checkpoint()
        except Exception as e:
            log.error("checkpoint on leave failed: %s", e)

    async def _leave_line(self, worker: DilocoWorker) -> None:
        sent, received = self.parts.plane.unreported_bytes() if self.parts is not None else (0, 0)
        self.writer.emit(LeaveEvent(round=worker.round, reason=self._reason, hash=worker.digest(), peer=self._peer_id,
                                    checkpoint=str(self._left_with or ""), bytes_sent=sent, bytes_received=received))

    async def _stop_island(self) -> None:
        """The island's other ranks exit: told so after the leave (or before their setup, when none came)."""
        if self.island is None:
            return
        reason = self._reason
        worker = self.worker if isinstance(self.worker, IslandWorker) else None
        try:
            if worker is not None:
                await asyncio.to_thread(worker.stop_island, reason)
            elif not self._island_lost.is_set():
                await asyncio.to_thread(self.island.broadcast_object, ("stop", reason))
        except IslandLost as e:
            log.warning("could not stop the island's other ranks: %s", e)

    async def _announce_departure(self, parts: PeerParts) -> None:
        """This peer's voter retires for good (stored before anything is announced), then the departure record
        says so: the rounds it would have voted in are counted without it."""
        try:
            retirements = await parts.driver.retire()
            record = departure_record(run_id=self.cfg.train.run_id, peer_id=self._peer_id,
                                      retirements={"": retirements}, now=parts.discovery.now())
            await announce_departure(parts.discovery, record, cfg=self.cfg)
        except Exception as e:  # best effort: without it the others count this voter until a commit drops it
            log.warning("could not announce this peer's departure: %s", e)

    # ------------------------------------------------------------------ status

    def snapshot(self) -> StatusSnapshot:
        w, part = self.worker, self.part
        return StatusSnapshot(
            peer_id=self._peer_id, run_id=self.cfg.train.run_id,
            phase=part.phase if part is not None and self.phase == "training" else self.phase,
            round=w.round if w else 0, state_hash=part.announced[1] if part else "",
            loss=part.last_loss if part else None, val_loss=part.last_val_loss if part else None,
            rounds_committed=part.rounds_committed if part else 0, rounds_aborted=part.rounds_aborted if part else 0)


