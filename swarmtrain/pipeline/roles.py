"""`swarmtrain peer --role server|trainer`: a pipeline stage server or trainer as a daemon.

Both join like a DiLoCo peer (the DHT, the run record of the coordinator `--join` names, the run's
config with the peer's own sections) and announce a peer record by heartbeat. A server holds one
stage (`--stage K`, else the stage with the fewest servers per block), starts from the weights of a
live server of that stage when there is one (a `heal` line), and serves it until signalled, printing
a `stage_step` line per inner step. A trainer reads the run's data, lists the live servers
from their records (stage, latency, queue) and trains `diloco.rounds × diloco.inner_steps` inner
steps through them, printing a `step` line per step, then leaves.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from swarmtrain.config import RunConfig
from swarmtrain.data import load_corpus
from swarmtrain.discovery import Discovery, Heartbeat, PeerRecord
from swarmtrain.models.gpt import resolve_shape
from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.data import peer_batches
from swarmtrain.peer.joining import fetch_run_config
from swarmtrain.peer.services import PeerError, PeerServices
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.memory import MB, server_bytes
from swarmtrain.pipeline.parts import build_ends, build_stage
from swarmtrain.pipeline.routing import Server
from swarmtrain.pipeline.server import StageServer, StageStats
from swarmtrain.pipeline.service import StageHandler, serve_stage
from swarmtrain.pipeline.tensors import TensorCodec
from swarmtrain.pipeline.trainer import PipelineTrainer
from swarmtrain.rpc.node import RpcNode
from swarmtrain.sync.transfer import StateServer, StateSnapshot, StateTransferError, fetch_state
from swarmtrain.telemetry import EventWriter, HealEvent, LeaveEvent, StageStepEvent, StepEvent
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
        self.node: RpcNode | None = None
        self.heartbeat: Heartbeat | None = None

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
        return discovery

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
        if self.node is not None:
            await asyncio.to_thread(self.node.close)
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
        self.server = StageServer(part, stage=self.stage, pipeline=pipe, inner=cfg.inner,
                                  total_steps=cfg.diloco.rounds * cfg.diloco.inner_steps, seq_len=cfg.data.seq_len,
                                  on_step=self._on_step)
        self.node = RpcNode(cfg.rpc, peer_id=discovery.peer_id)
        codec = TensorCodec(pipe.activation_codec, max_shape=(pipe.microbatch_size, cfg.data.seq_len, shape.n_embd))
        self.handler = serve_stage(self.node, self.server, codec=codec)
        StateServer(self.node).serve(self._live_part)  # for servers that join this stage later
        await asyncio.to_thread(self.node.start, timeout_s=cfg.rpc.call_timeout_s + 10.0)
        await self._heal(discovery)
        await self._announce()
        blocks = stage_blocks(shape.n_layer, pipe.stages)[self.stage]
        info = {"role": "server", "peer_id": discovery.peer_id, "endpoint": self.node.endpoint,
                "run_id": cfg.train.run_id, "stage": self.stage, "blocks": [blocks.start, blocks.stop],
                "num_params": sum(p.numel() for p in part.parameters())}
        self.writer.ready(info)
        return info

    @contextlib.contextmanager
    def _live_part(self) -> Iterator[tuple[Hashable, StateSnapshot] | None]:
        """This stage's weights for a joining server, held still while they are copied."""
        server = self.server
        if server is None:
            yield None
            return
        with server.still():
            yield server.version, StateSnapshot(round=server.step, params=server.part.state_dict(), momentum={},
                                                config=self.cfg)

    async def _heal(self, discovery: Discovery) -> None:
        """Start from the weights of a live server of this stage (the one furthest on first), if there is one."""
        assert self.server is not None and self.node is not None
        cfg = self.cfg
        peers = await discovery.live_peers(timeout_s=cfg.rpc.call_timeout_s)
        donors = sorted((p for p in peers if p.role == "stage_server" and p.stage == self.stage and p.endpoint
                         and p.peer_id != discovery.peer_id), key=lambda p: -p.round)
        shapes = {name: tuple(t.shape) for name, t in self.server.part.state_dict().items()}
        for donor in donors:
            start = time.perf_counter()
            try:
                snapshot = await asyncio.to_thread(fetch_state, self.node, [donor.endpoint], run_id=cfg.train.run_id,
                                                   expected_shapes=shapes, timeout_s=4 * cfg.rpc.call_timeout_s)
                if snapshot.config.train.run_nonce != cfg.train.run_nonce:
                    raise StateTransferError(f"its state is of another run (nonce {snapshot.config.train.run_nonce!r})")
                await asyncio.to_thread(self.server.adopt, snapshot.params, step=snapshot.round)
            except (StateTransferError, ValueError) as e:
                log.warning("stage %d: no state from %s: %s", self.stage, donor.peer_id, e)
                continue
            self.writer.emit(HealEvent(from_round=0, to_round=snapshot.round, source=donor.peer_id, hash="",
                                       peer=discovery.peer_id, transfer_s=round(time.perf_counter() - start, 4)))
            return
        if donors:
            log.warning("stage %d: no live server of this stage gave its weights; starting from the run's init",
                        self.stage)

    def _record(self) -> PeerRecord:
        assert self.discovery is not None and self.node is not None and self.server is not None
        assert self.handler is not None and self.stage is not None
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id, endpoint=self.node.endpoint,
                          role="stage_server", stage=self.stage, round=self.server.step,
                          latency_s=self.handler.latency_s, queue=self.handler.waiting)

    def _on_step(self, stats: StageStats) -> None:  # on the server's compute thread
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
        self.node = RpcNode(cfg.rpc, peer_id=discovery.peer_id, serve=False)
        await asyncio.to_thread(self.node.start, timeout_s=cfg.rpc.call_timeout_s + 10.0)
        self.trainer = PipelineTrainer(self.node, ends, cfg, servers=lambda: self._servers,
                                       hints=lambda: self._hints)
        await self._list_servers()
        self._lister = asyncio.create_task(self._keep_listing())
        await self._announce()
        info = {"role": "trainer", "peer_id": discovery.peer_id, "run_id": cfg.train.run_id,
                "stages": cfg.pipeline.stages, "servers": len(self._servers),
                "num_params": sum(p.numel() for p in ends.parameters())}
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
        assert self.discovery is not None and self.trainer is not None
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id, endpoint="",
                          role="trainer", client_mode=True, round=self.trainer.step_count)

    async def run(self, stop: asyncio.Event) -> str:
        """Train until the run's inner steps are done (→ "done") or `stop` (→ "signal")."""
        assert self.trainer is not None and self.node is not None and self.discovery is not None
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
