"""`swarmtrain peer --role server|trainer`: a pipeline stage server or trainer as a daemon.

Both join like a DiLoCo peer (the DHT, the run record of the coordinator `--join` names, the run's
config with the peer's own sections: base.py) and announce a peer record by heartbeat (part_role.py). A server
holds one stage (stage_server.py: `--stage K`, else the stage with the fewest servers per block), starts
from its stage's θ_global when the stage's servers are past round 0 (a `heal` line), serves it until
signalled, printing a `stage_step` line per inner step, and with `pipeline.rebalance` moves to the
bottleneck stage (rebalance.py). A trainer reads the run's data, lists the live servers from their
records (stage, latency, queue) and trains `diloco.rounds × diloco.inner_steps` inner steps through
them, printing a `step` line per step, then leaves. Each averages its part with the other holders of
that part (outer.py: a stage's servers, the trainers), printing a `stage_round` line per round; one
node serves its calls, the all-reduce and its part's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from swarmtrain.config import RunConfig
from swarmtrain.data import load_corpus
from swarmtrain.discovery import PeerRecord
from swarmtrain.peer.data import peer_batches
from swarmtrain.peer.network import round_budget_s
from swarmtrain.pipeline.parts import build_ends
from swarmtrain.pipeline.placement import servers_of
from swarmtrain.pipeline.routing import Server
from swarmtrain.pipeline.trainer import PipelineTrainer
from swarmtrain.roles.part_role import PartRole
from swarmtrain.telemetry import LeaveEvent, StepEvent

__all__ = ["TrainerRole"]

log = logging.getLogger(__name__)


class TrainerRole(PartRole):
    role = "trainer"

    def __init__(self, local: RunConfig, **kw: Any) -> None:
        super().__init__(local, **kw)
        self.trainer: PipelineTrainer | None = None
        self._servers: list[Server] = []
        self._hints: dict[Server, tuple[float, int]] = {}
        self._batches: Any = None
        self._lister: asyncio.Task[None] | None = None

    async def start(self) -> dict[str, Any]:
        discovery = await self._join_pipeline()
        cfg = self.cfg
        ends = await asyncio.to_thread(build_ends, cfg.model, seed=cfg.train.seed)
        corpus = await asyncio.to_thread(load_corpus, cfg.data)
        steps_cfg = cfg.replace(data={"batch_size": cfg.pipeline.samples_per_step})
        self._batches = iter(peer_batches(steps_cfg, corpus.train, discovery.peer_id))
        scoped, self.plane, self.node = await self._open_plane(ends, scope="ends", role="trainer",
                                                               member=lambda p: p.role == "trainer")
        self.trainer = PipelineTrainer(self.node, ends, cfg, servers=lambda: self._servers,
                                       hints=lambda: self._hints)
        # Applied between steps (settle): a step's micro-batches use the ends' weights throughout.
        rounds = self.rounds = self._rounds(ends, self.plane, scoped, stage=-1, moving=contextlib.nullcontext,
                                            apply_now=False, role="trainer")
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
            report = await self.node.call(self.trainer.step_async(idx, targets))
            self.writer.emit(StepEvent(step=report.step, loss=None if report.lost == report.microbatches
                                       else report.loss, samples=report.samples, microbatches=report.microbatches,
                                       rerouted=report.rerouted, lost=report.lost,
                                       stage_latency_s=tuple(round(s, 4) for s in report.stage_latency_s),
                                       peer=self.discovery.peer_id, lost_reasons=tuple(report.lost_reasons),
                                       at=time.time()))
            self.rounds.stepped()
            await self.rounds.settle()
        # The last round: the other trainers average it too (bounded: matchmaking, then the all-reduce).
        await self.rounds.finish(timeout_s=round_budget_s(self.cfg))
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
