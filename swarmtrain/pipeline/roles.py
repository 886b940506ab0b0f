"""`swarmtrain peer --role server|trainer`: a pipeline stage server or trainer as a daemon.

Both join like a DiLoCo peer (the DHT, the run record of the coordinator `--join` names, the run's
config with the peer's own sections) and announce a peer record by heartbeat. A server holds one
stage (`--stage K`, else the stage with the fewest servers per block), starts from its stage's
θ_global when the stage's servers are past round 0 (a `heal` line), and serves it until signalled,
printing a `stage_step` line per inner step. A trainer reads the run's data, lists the live servers
from their records (stage, latency, queue) and trains `diloco.rounds × diloco.inner_steps` inner
steps through them, printing a `step` line per step, then leaves. Each averages its part with the
other holders of that part (outer.py: a stage's servers, the trainers), printing a `stage_round` line
per round; one node serves its calls, the all-reduce and its part's state.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from swarmtrain.compress import codec_from_config
from swarmtrain.config import RunConfig
from swarmtrain.data import load_corpus
from swarmtrain.discovery import Discovery, Heartbeat, PeerRecord, ScopedDiscovery
from swarmtrain.models.gpt import resolve_shape
from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.data import peer_batches, peer_seed
from swarmtrain.peer.joining import fetch_run_config
from swarmtrain.peer.services import DataPlane, PeerError, PeerServices
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.memory import MB, server_bytes
from swarmtrain.pipeline.outer import PartRounds
from swarmtrain.pipeline.parts import build_ends, build_stage
from swarmtrain.pipeline.routing import Server
from swarmtrain.pipeline.server import StageServer, StageStats
from swarmtrain.pipeline.service import StageHandler, serve_stage
from swarmtrain.pipeline.tensors import TensorCodec
from swarmtrain.pipeline.trainer import PipelineTrainer
from swarmtrain.rpc.node import RpcNode
from swarmtrain.telemetry import EventWriter, LeaveEvent, StageStepEvent, StepEvent
from swarmtrain.telemetry.tally import Tally
from swarmtrain.trust import resolve_run_key

__all__ = ["StageServerRole", "TrainerRole", "least_served_stage", "servers_of"]

log = logging.getLogger(__name__)


def servers_of(peers: Sequence[PeerRecord], stages: int) -> tuple[list[Server], dict[Server, tuple[float, int]]]:
    """The stage servers among live peer records, with the (latency, queue) each published."""
    servers, hints = [], {}
    for p in peers:
        if p.role == "stage_server" and 0 <= p.stage < stages and p.endpoint:
            s = Server(p.peer_id, p.endpoint, p.stage)
            servers.append(s)
            hints[s] = (p.latency_s, p.queue)
    return servers, hints


def least_served_stage(peers: Sequence[PeerRecord], *, n_layer: int, stages: int,
                       allowed: Sequence[int] | None = None) -> int:
    """Of the `allowed` stages (default all), the one with the fewest live servers per block it holds (its
    demand: every micro-batch passes every block once); the earliest on a tie."""
    counts = [0] * stages
    for s in servers_of(peers, stages)[0]:
        counts[s.stage] += 1
    sizes = [len(blocks) for blocks in stage_blocks(n_layer, stages)]
    return min(range(stages) if allowed is None else allowed, key=lambda k: (counts[k] / sizes[k], k))


def _fitting_stages(cfg: RunConfig) -> list[int]:
    """The stages whose training state fits this peer's `train.memory_budget_mb` (all without one)."""
    need = server_bytes(cfg.model, cfg.pipeline, seq_len=cfg.data.seq_len)
    budget = cfg.train.memory_budget_mb
    fitting = [k for k, b in enumerate(need) if not budget or b <= budget * MB]
    if not fitting:
        raise PeerError(f"no stage fits train.memory_budget_mb={budget}: the smallest needs "
                        f"{min(need) / MB:.0f} MB (docs/pipeline.md#memory); cut the model into more stages")
    return fitting


class _Role(abc.ABC):
    role = ""

    def __init__(self, local: RunConfig, *, writer: EventWriter, services: PeerServices,
                 local_overrides: Sequence[str] = (), coordinator_id: str | None = None) -> None:
        self.local = local
        self.writer = writer
        self.services = services
        self.local_overrides = tuple(local_overrides)
        self.coordinator_id = coordinator_id
        self.cfg = local
        self.discovery: Discovery | None = None
        self.node: RpcNode | None = None  # the plane's: the role's calls, the all-reduce, its part's state
        self.plane: DataPlane | None = None
        self.rounds: PartRounds | None = None
        self.heartbeat: Heartbeat | None = None
        self.tally, self.metrics = Tally(), ""  # its work so far (record stats, /metrics at `metrics`: host:port)
        writer.listeners.append(self.tally.observe)

    async def _join(self) -> Discovery:
        discovery = await self.services.open_discovery(self.local.discovery, run_id=self.local.train.run_id,
                                                       run_key=resolve_run_key(self.local.rpc.run_key))
        self.discovery = discovery
        run = await fetch_run_config(discovery, self.local, coordinator_id=self.coordinator_id)
        self.cfg = merge_run_config(run, self.local, local_overrides=self.local_overrides)
        if self.cfg.pipeline.stages < 1:
            raise PeerError(f"run {self.cfg.train.run_id!r} has no pipeline (pipeline.stages = 0): join it without "
                            "--role, as a DiLoCo worker")
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        self.tally.seq_len, self.tally.peer, self.tally.role = self.cfg.data.seq_len, discovery.peer_id, self.role
        return discovery

    async def _open_plane(self, part: torch.nn.Module, *, scope: str, member: Any, role: str,
                          serve: Any = None) -> ScopedDiscovery:
        """The data plane of `part`'s holders (its matchmaking under `scope`; `serve(node)` adds this role's
        own service before the node listens); returns the scope's view of the DHT."""
        assert self.discovery is not None
        cfg = self.cfg
        scoped = ScopedDiscovery(self.discovery, scope=scope, member=member)
        codec = codec_from_config(cfg.compress, seed=peer_seed(cfg.train.seed + 2, self.discovery.peer_id))

        def before_start(node: RpcNode) -> None:
            self.node = node
            if serve is not None:
                serve(node)

        self.plane = await self.services.open_data_plane(
            cfg, discovery=scoped, codec=codec, role=role, before_start=before_start,
            param_shapes=[(name, tuple(p.shape)) for name, p in part.named_parameters()])
        return scoped

    def _rounds(self, part: torch.nn.Module, scoped: ScopedDiscovery, *, stage: int, still: Any,
                apply_now: bool, on_heal: Any = None) -> PartRounds:
        assert self.plane is not None
        self.rounds = PartRounds(list(part.parameters()), plane=self.plane, discovery=scoped, cfg=self.cfg,
                                 stage=stage, still=still, emit=self.writer.emit, apply_now=apply_now,
                                 on_heal=on_heal)
        return self.rounds

    def _part_fields(self) -> dict[str, Any]:
        """The record's fields of this role's part: its outer round, θ_global's hash, when its round ends."""
        assert self.rounds is not None
        return {"round": self.rounds.round, "state_hash": self.rounds.hash,
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
        """Stop beating, withdraw the record, close the data plane and the DHT node (each best effort)."""
        if self.heartbeat is not None:
            await self.heartbeat.aclose(withdraw=True)
        if self.rounds is not None:
            await self.rounds.aclose()
        if self.plane is not None:
            await self.plane.aclose()
        if self.discovery is not None:
            await self.discovery.aclose()
        log.info("%s left: %s", self.role, reason)


class StageServerRole(_Role):
    role = "stage_server"

    def __init__(self, local: RunConfig, *, stage: int | None = None, **kw: Any) -> None:
        super().__init__(local, **kw)
        self.stage = stage
        self.server: StageServer | None = None
        self.handler: StageHandler | None = None
        self._last_step = (0, time.monotonic())

    async def start(self) -> dict[str, Any]:
        discovery = await self._join()
        cfg, pipe = self.cfg, self.cfg.pipeline
        shape = resolve_shape(cfg.model)
        fitting = _fitting_stages(cfg)
        if self.stage is None:
            peers = await discovery.live_peers(timeout_s=cfg.rpc.call_timeout_s)
            self.stage = least_served_stage(peers, n_layer=shape.n_layer, stages=pipe.stages, allowed=fitting)
        if not 0 <= self.stage < pipe.stages:
            raise PeerError(f"--stage {self.stage}: this run has stages 0..{pipe.stages - 1}")
        if self.stage not in fitting:
            need = server_bytes(cfg.model, pipe, seq_len=cfg.data.seq_len)[self.stage]
            raise PeerError(f"stage {self.stage} needs {need / MB:.0f} MB to train, more than train.memory_budget_mb="
                            f"{cfg.train.memory_budget_mb} (stages that fit: {fitting})")
        part = await asyncio.to_thread(build_stage, cfg.model, self.stage, pipe.stages, seed=cfg.train.seed)
        server = self.server = StageServer(part, stage=self.stage, pipeline=pipe, inner=cfg.inner,
                                           total_steps=cfg.diloco.rounds * cfg.diloco.inner_steps,
                                           seq_len=cfg.data.seq_len, on_step=self._on_step)
        codec = TensorCodec(pipe.activation_codec, max_shape=(pipe.microbatch_size, cfg.data.seq_len, shape.n_embd))

        def serve(node: RpcNode) -> None:
            self.handler = serve_stage(node, server, codec=codec)

        k = self.stage
        scoped = await self._open_plane(part, scope=f"stage{k}", role="stage_server", serve=serve,
                                        member=lambda p: p.role == "stage_server" and p.stage == k)
        h = cfg.diloco.inner_steps  # a healed server takes up the schedule where its stage's round puts it
        rounds = self._rounds(part, scoped, stage=k, still=server.moving, apply_now=True,
                              on_heal=lambda r: server.resume_at(r * h))
        await rounds.join()  # the stage's θ_global if its servers are past round 0
        await self._announce()
        rounds.start()
        assert self.node is not None
        blocks = stage_blocks(shape.n_layer, pipe.stages)[self.stage]
        info = {"role": "server", "peer_id": discovery.peer_id, "endpoint": self.node.endpoint,
                "run_id": cfg.train.run_id, "stage": self.stage, "blocks": [blocks.start, blocks.stop],
                "num_params": sum(p.numel() for p in part.parameters()), **self._metrics_info()}
        self.writer.ready(info)
        return info

    def _record(self) -> PeerRecord:
        assert self.discovery is not None and self.node is not None and self.server is not None
        assert self.handler is not None and self.stage is not None
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id, endpoint=self.node.endpoint,
                          role="stage_server", stage=self.stage, latency_s=self.handler.latency_s,
                          queue=self.handler.waiting, **self._part_fields())

    def _on_step(self, stats: StageStats) -> None:  # on the server's compute thread, the weights still
        if self.rounds is not None:
            self.rounds.stepped()
        steps, at = self._last_step
        now = time.monotonic()
        rate = self.cfg.pipeline.samples_per_step * (stats.step - steps) / max(now - at, 1e-9)
        self._last_step = (stats.step, now)
        self.writer.emit(StageStepEvent(stage=stats.stage, step=stats.step, samples_per_s=round(rate, 3),
                                        forwards=stats.forwards, backwards=stats.backwards, refused=stats.refused,
                                        peer=self.discovery.peer_id if self.discovery else "", at=time.time()))

    async def run(self, stop: asyncio.Event) -> str:
        """Serve until `stop` (a server has no end of its own: the trainers decide when the run is over)."""
        await stop.wait()
        return "signal"

    async def aclose(self, reason: str) -> None:
        step = self.server.step if self.server is not None else 0
        await super().aclose(reason)
        if self.handler is not None:
            await asyncio.to_thread(self.handler.close)
        self.writer.emit(LeaveEvent(round=step, reason=reason,
                                    peer=self.discovery.peer_id if self.discovery is not None else ""))


class TrainerRole(_Role):
    role = "trainer"

    def __init__(self, local: RunConfig, **kw: Any) -> None:
        super().__init__(local, **kw)
        self.trainer: PipelineTrainer | None = None
        self._servers: list[Server] = []
        self._hints: dict[Server, tuple[float, int]] = {}
        self._batches: Any = None
        self._lister: asyncio.Task[None] | None = None

    async def start(self) -> dict[str, Any]:
        discovery = await self._join()
        cfg = self.cfg
        ends = await asyncio.to_thread(build_ends, cfg.model, seed=cfg.train.seed)
        corpus = await asyncio.to_thread(load_corpus, cfg.data)
        steps_cfg = cfg.replace(data={"batch_size": cfg.pipeline.samples_per_step})
        self._batches = iter(peer_batches(steps_cfg, corpus.train, discovery.peer_id))
        scoped = await self._open_plane(ends, scope="ends", role="trainer", member=lambda p: p.role == "trainer")
        assert self.node is not None
        self.trainer = PipelineTrainer(self.node, ends, cfg, servers=lambda: self._servers,
                                       hints=lambda: self._hints)
        # Applied between steps (settle): a step's micro-batches use the ends' weights throughout.
        rounds = self._rounds(ends, scoped, stage=-1, still=contextlib.nullcontext, apply_now=False)
        await rounds.join()
        rounds.start()
        await self._list_servers()
        self._lister = asyncio.create_task(self._keep_listing())
        await self._announce()
        info = {"role": "trainer", "peer_id": discovery.peer_id, "run_id": cfg.train.run_id,
                "stages": cfg.pipeline.stages, "servers": len(self._servers),
                "num_params": sum(p.numel() for p in ends.parameters()), **self._metrics_info()}
        self.writer.ready(info)
        return info

    async def _list_servers(self) -> None:
        assert self.discovery is not None
        try:
            peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:  # a slow control plane: keep the last list
            log.warning("could not list the stage servers (%s); keeping the last list", e)
            return
        self._servers, self._hints = servers_of(peers, self.cfg.pipeline.stages)

    async def _keep_listing(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.discovery.heartbeat_s)
            await self._list_servers()

    def _record(self) -> PeerRecord:
        assert self.discovery is not None and self.node is not None
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id, endpoint=self.node.endpoint,
                          role="trainer", client_mode=self.cfg.discovery.client_mode, **self._part_fields())

    async def run(self, stop: asyncio.Event) -> str:
        """Train until the run's inner steps are done (→ "done") or `stop` (→ "signal")."""
        assert self.trainer is not None and self.node is not None and self.discovery is not None
        assert self.rounds is not None
        total = self.cfg.diloco.rounds * self.cfg.diloco.inner_steps
        while self.trainer.step_count < total:
            if stop.is_set():
                return "signal"
            idx, targets = next(self._batches)
            step = asyncio.run_coroutine_threadsafe(self.trainer.step_async(idx, targets), self.node.loop)
            report = await asyncio.wrap_future(step)
            self.writer.emit(StepEvent(step=report.step, loss=None if report.lost == report.microbatches
                                       else report.loss, samples=report.samples, microbatches=report.microbatches,
                                       rerouted=report.rerouted, lost=report.lost,
                                       stage_latency_s=tuple(round(s, 4) for s in report.stage_latency_s),
                                       peer=self.discovery.peer_id, lost_reasons=tuple(report.lost_reasons),
                                       at=time.time()))
            self.rounds.stepped()
            await self.rounds.settle()
        a, r = self.cfg.averaging, self.cfg.rpc
        # The last round: the other trainers average it too (bounded: matchmaking, then the all-reduce).
        await self.rounds.finish(timeout_s=4 * a.matchmaking_timeout_s + 4 * r.call_timeout_s + a.allreduce_timeout_s)
        return "done"

    async def aclose(self, reason: str) -> None:
        if self._lister is not None:
            self._lister.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lister
        step = self.trainer.step_count if self.trainer is not None else 0
        await super().aclose(reason)
        self.writer.emit(LeaveEvent(round=step, reason=reason,
                                    peer=self.discovery.peer_id if self.discovery is not None else ""))
