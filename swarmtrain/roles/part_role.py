"""What both pipeline roles share: a part's data plane and outer rounds, the peer record's heartbeat, and
leaving a part's scope (its voter retired, the departure record)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from typing import Any

import torch

from swarmtrain.compress import codec_from_config
from swarmtrain.config import RunConfig
from swarmtrain.diloco.flat import param_shapes
from swarmtrain.discovery import Discovery, Heartbeat, PeerRecord, ScopedDiscovery
from swarmtrain.driver.loop import announce_departure, departure_record
from swarmtrain.peer.data import peer_seed
from swarmtrain.peer.joining import GenesisReader
from swarmtrain.peer.network import NetworkPlane
from swarmtrain.peer.services import PeerError
from swarmtrain.pipeline.outer import PartRounds
from swarmtrain.roles.base import RoleBase
from swarmtrain.round.certificate import Retirement
from swarmtrain.rpc.node import RpcNode
from swarmtrain.trust.identity import verifier

__all__ = ["PartRole"]

log = logging.getLogger(__name__)


class PartRole(RoleBase):
    """What a server and a trainer share: a part's data plane and rounds, the heartbeat."""

    def __init__(self, local: RunConfig, **kw: Any) -> None:
        super().__init__(local, **kw)
        self.discovery: Discovery | None = None
        self.coordinator = ""  # the peer id that signed the run record (it fixes each scope's genesis)
        self.node: RpcNode | None = None  # the plane's: the role's calls, the all-reduce, its part's state
        self.plane: NetworkPlane | None = None
        self.rounds: PartRounds | None = None
        self._retired: dict[str, list[Retirement]] = {}  # scope -> its voter's retirements (a departure record)
        self.heartbeat: Heartbeat | None = None

    async def _join_pipeline(self) -> Discovery:
        discovery, record = await self._join()  # a part of another model must not join the stage's swarm
        self.discovery, self.coordinator = discovery, record.coordinator_id
        if self.cfg.pipeline.stages < 1:
            raise PeerError(f"run {self.cfg.train.run_id!r} has no pipeline (pipeline.stages = 0): join it without "
                            "--role, as a DiLoCo worker")
        self.tally.seq_len = self.cfg.data.seq_len
        return discovery

    async def _open_plane(self, part: torch.nn.Module, *, scope: str, member: Any, role: str,
                          serve: Any = None) -> tuple[ScopedDiscovery, NetworkPlane, RpcNode]:
        """The data plane of `part`'s holders (its matchmaking under `scope`; `serve(node)` adds this role's
        own service before the node listens), with the scope's view of the DHT and the plane's node."""
        assert self.discovery is not None
        cfg = self.cfg
        scoped = ScopedDiscovery(self.discovery, scope=scope, member=member)
        codec = codec_from_config(cfg.compress, seed=peer_seed(cfg.train.seed + 2, self.discovery.peer_id))
        nodes: list[RpcNode] = []

        def before_start(node: RpcNode) -> None:
            nodes.append(node)
            if serve is not None:
                serve(node)

        plane = await self.services.open_data_plane(
            cfg, discovery=scoped, codec=codec, scope=scope, role=role, before_start=before_start,
            param_shapes=param_shapes(part))
        return scoped, plane, nodes[0]

    def _rounds(self, part: torch.nn.Module, plane: NetworkPlane, scoped: ScopedDiscovery, *, stage: int, moving: Any,
                apply_now: bool, role: str, on_heal: Any = None, still: Any = None) -> PartRounds:
        cfg = self.cfg
        rounds = PartRounds(list(part.parameters()), plane=plane, discovery=scoped, cfg=cfg, stage=stage,
                            moving=moving, emit=self.writer.emit, apply_now=apply_now, role=role,
                            run=f"{cfg.train.run_id}/{cfg.train.run_nonce}", verify=verifier(scoped.key_binding),
                            genesis=GenesisReader(scoped, coordinator_id=self.coordinator, scope=plane.scope,
                                                  timeout_s=cfg.rpc.call_timeout_s),
                            incarnation=lambda: plane.incarnation, on_heal=on_heal, still=still,
                            changed=self._beat_soon)
        plane.attach(rounds.part.outcome_of, round_now=lambda: rounds.round)
        return rounds

    def _beat_soon(self) -> None:
        """The part's committed state changed: announce it at once (its record names the round and digest)."""
        if self.heartbeat is not None:
            self._beat = asyncio.ensure_future(self._beat_once())

    async def _beat_once(self) -> None:
        if self.heartbeat is not None:
            with contextlib.suppress(Exception):  # the periodic beat announces it anyway
                await self.heartbeat.beat()

    async def _retire(self, scope: str, rounds: PartRounds) -> None:
        """This peer leaves `scope` for good: its voter there retires, and the departure record says so (with
        every scope it left)."""
        self._retired[scope] = await rounds.aclose(retire=True)
        if self.discovery is None or not any(self._retired.values()):
            return
        record = departure_record(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id,
                                  retirements=self._retired, now=self.discovery.now())
        try:
            await announce_departure(self.discovery, record, cfg=self.cfg)
        except Exception as e:  # best effort: the others count this voter until a commit drops it
            log.warning("could not announce this peer's departure from %r: %s", scope, e)

    def _part_fields(self) -> dict[str, Any]:
        """The record's fields of this role's part: its outer round, its state's digest, its voter's incarnation,
        when its round ends."""
        assert self.rounds is not None and self.plane is not None
        return {"round": self.rounds.round, "state_hash": self.rounds.hash, "incarnation": self.plane.incarnation,
                "round_ends_at": self.rounds.round_ends_at(), "stats": self.tally.stats()}

    def _metrics_info(self) -> dict[str, str]:
        return {"metrics": self.metrics} if self.metrics else {}

    @abc.abstractmethod
    def _record(self) -> PeerRecord:
        """The peer record this role announces by heartbeat."""

    async def _announce(self) -> None:
        assert self.discovery is not None
        cfg = self.cfg
        self.heartbeat = Heartbeat(self.discovery, current=self._record, heartbeat_s=cfg.discovery.heartbeat_s,
                                   now=self.discovery.now, timeout_s=cfg.rpc.call_timeout_s)
        await self.heartbeat.start()

    async def aclose(self, reason: str) -> None:
        """Stop beating, withdraw the record, retire the part's voter, close the data plane, and whatever failed
        before, what joining opened (the DHT node, the directory claim)."""
        try:
            if self.heartbeat is not None:
                await self.heartbeat.aclose(withdraw=True)
            if self.rounds is not None and self.plane is not None:
                await self._retire(self.plane.scope, self.rounds)
            if self.plane is not None:
                await self.plane.aclose()
        finally:
            await self._opened.aclose()
        log.info("%s left: %s", self.role, reason)
