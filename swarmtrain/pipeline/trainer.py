"""A pipeline trainer: the embeddings and the head here, the blocks on stage servers, one step at a time.

Each micro-batch of a step goes forward through one server per stage (routing.py picks it) and its gradient
back through the same servers in reverse. The trainer keeps every stage boundary's input until the
micro-batch completes, so a failure at stage k re-sends from stage k's input, never from the start: a
forward that fails or passes its deadline goes to another server of the stage; a backward whose server died,
restarted or dropped the micro-batch's input runs that stage's forward again on some server and the backward
there. When every listed server of a stage failed a call, one that only passed its adaptive deadline is
called once more with the whole `pipeline.call_timeout_s`; else the trainer reads the server list again
until it names another (a server restarting, a new one), for up to `pipeline.call_timeout_s` and at least
until a dead server's record has expired and dropped out of the list (`discovery.record_ttl_s` +
`heartbeat_s`); while it lists none (a lost stage, being taken), for up to `pipeline.stage_wait_s`. A
micro-batch is lost only when a stage has no server that answers within that time; it is counted and its
reason kept. (One lost in its backward has already added its gradients to the stages after the failing one
and to the head.)
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmtrain.config import RunConfig
from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
from swarmtrain.pipeline.errors import BadActivation, StageLost
from swarmtrain.pipeline.parts import Ends
from swarmtrain.pipeline.routing import Router, Server
from swarmtrain.pipeline.tensors import TensorCodec
from swarmtrain.rpc.errors import RpcError, RpcRejected, RpcTimeout
from swarmtrain.rpc.node import RpcNode
from swarmtrain.rpc.pipeline_wire import PipelineClient
from swarmtrain.wire import pipeline_pb2 as pb

__all__ = ["PipelineTrainer", "StepReport"]

_CONTEXT_GONE = ("NOT_FOUND", "ABORTED")  # the server is fine; the micro-batch's input there is not
_LIST_POLL_S = 0.25  # how often the server list is read again while a stage has no server left to try


@dataclass
class StepReport:
    """One trainer step, as its JSON line prints it."""

    step: int
    loss: float
    samples: int
    microbatches: int
    rerouted: int
    lost: int
    stage_latency_s: list[float]
    lost_reasons: list[str] = field(default_factory=list)

    def line(self) -> dict[str, Any]:
        return {"event": "step", "step": self.step, "loss": round(self.loss, 6), "samples": self.samples,
                "microbatches": self.microbatches, "rerouted": self.rerouted, "lost": self.lost,
                "stage_latency_s": [round(s, 4) for s in self.stage_latency_s], "lost_reasons": self.lost_reasons}


@dataclass
class _Tally:
    rerouted: int = 0
    seconds: list[list[float]] = field(default_factory=list)


class PipelineTrainer:
    """Drives micro-batches through the stages; `servers()` lists the live stage servers (their records)."""

    def __init__(self, node: RpcNode, ends: Ends, cfg: RunConfig, *, servers: Callable[[], Sequence[Server]],
                 hints: Callable[[], Mapping[Server, tuple[float, int]]] | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 max_inflight: int = 0) -> None:
        if cfg.pipeline.stages < 1:
            raise ValueError("PipelineTrainer: pipeline.stages is 0 (no pipeline in this run)")
        self.node = node
        self.ends = ends
        self.cfg = cfg
        self.pipe = cfg.pipeline
        self.servers = servers
        self.hints = hints or dict
        self.rng = rng or random.Random()
        self.router = Router(self.pipe, clock=clock, rng=self.rng)
        self.clock = clock
        self.codec = TensorCodec(self.pipe.activation_codec,
                                 max_shape=(self.pipe.microbatch_size, cfg.data.seq_len,
                                            cfg.model.shape_value("n_embd")))
        self.client = PipelineClient(node, bulk_min_bytes=self.pipe.bulk_min_bytes, max_bytes=self.codec.max_bytes)
        self.optimizer = build_inner_optimizer(ends, cfg.inner)
        self.total_steps = cfg.diloco.rounds * cfg.diloco.inner_steps
        self.max_inflight = max_inflight or self.pipe.samples_per_step // self.pipe.microbatch_size
        # Every listed server of a stage failed a call: wait for another, at least until a dead server's record
        # has expired and a read of the list has dropped it (the stage then counts as unserved: stage_wait_s).
        self.listed_wait_s = max(self.pipe.call_timeout_s, cfg.discovery.record_ttl_s + cfg.discovery.heartbeat_s)
        self._lock = threading.Lock()  # the ends' autograd: one micro-batch at a time
        self.step_count = 0
        self._sent = 0
        set_lr(self.optimizer, cfg.inner.lr * lr_factor(0, cfg=cfg.inner, total_steps=self.total_steps))
        ends.train()

    def step(self, idx: torch.Tensor, targets: torch.Tensor, *, timeout_s: float = 600.0) -> StepReport:
        """One inner step over (samples_per_step, T) tokens and targets (blocking; runs on the node's loop)."""
        return self.node.run(self.step_async(idx, targets), timeout_s=timeout_s)

    async def step_async(self, idx: torch.Tensor, targets: torch.Tensor) -> StepReport:
        n = self.pipe.samples_per_step
        if idx.shape[0] != n or targets.shape != idx.shape:
            raise ValueError(f"a step takes ({n}, T) tokens and targets of one shape, got {tuple(idx.shape)} and "
                             f"{tuple(targets.shape)}")
        self.router.update(self.servers(), hints=self.hints())
        tally = _Tally(seconds=[[] for _ in range(self.pipe.stages)])
        gate = asyncio.Semaphore(self.max_inflight)
        size = self.pipe.microbatch_size

        async def one(i: int) -> tuple[float | None, str]:
            async with gate:
                return await self._microbatch(i, idx[i * size:(i + 1) * size], targets[i * size:(i + 1) * size],
                                              size / n, tally)

        results = await asyncio.gather(*(one(i) for i in range(n // size)))
        await asyncio.to_thread(self._step_ends)
        losses = [loss for loss, _ in results if loss is not None]
        self.step_count += 1
        return StepReport(step=self.step_count, loss=sum(losses) / len(losses) if losses else float("nan"),
                          samples=size * len(losses), microbatches=len(results), rerouted=tally.rerouted,
                          lost=len(results) - len(losses), lost_reasons=[why for loss, why in results if loss is None],
                          stage_latency_s=[sum(s) / len(s) if s else 0.0 for s in tally.seconds])

    def _step_ends(self) -> None:
        with self._lock:
            if self.cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.ends.parameters(), self.cfg.inner.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            set_lr(self.optimizer, self.cfg.inner.lr * lr_factor(self.step_count + 1, cfg=self.cfg.inner,
                                                                 total_steps=self.total_steps))

    # -- one micro-batch -----------------------------------------------------------------------------
    async def _microbatch(self, i: int, idx: torch.Tensor, targets: torch.Tensor, scale: float,
                          tally: _Tally) -> tuple[float | None, str]:
        self._sent += 1
        mb = f"{self.step_count}.{i}.{self._sent}"
        seeds = [self.rng.getrandbits(63) for _ in range(self.pipe.stages)]
        x0 = await asyncio.to_thread(self._embed, idx)
        inputs = [x0.detach()]
        used: list[Server] = []
        try:
            for k in range(self.pipe.stages):
                y, server = await self._forward(k, mb, inputs[k], seeds[k], tally)
                inputs.append(y)
                used.append(server)
            loss, grad = await asyncio.to_thread(self._head, inputs[-1], targets, scale)
            for k in reversed(range(self.pipe.stages)):
                grad = await self._backward(k, mb, inputs[k], grad, used[k], seeds[k], idx.shape[0], tally)
        except StageLost as e:
            return None, str(e)
        await asyncio.to_thread(self._embed_backward, x0, grad)
        return loss, ""

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return self.ends.embed(idx)

    def _head(self, y: torch.Tensor, targets: torch.Tensor, scale: float) -> tuple[float, torch.Tensor]:
        with self._lock:
            y = y.detach().requires_grad_(True)
            loss = self.ends.loss(y, targets)
            (loss * scale).backward()
            assert y.grad is not None
            return loss.item(), y.grad

    def _embed_backward(self, x0: torch.Tensor, grad: torch.Tensor) -> None:
        with self._lock:
            x0.backward(grad)

    # -- calls to the stages ---------------------------------------------------------------------------
    async def _call(self, server: Server, method: str, mb: str, x: torch.Tensor, *, seed: int = 0,
                    samples: int = 0, patient: bool = False) -> torch.Tensor:
        shape, data = self.codec.encode(x)
        call = pb.StageCall(stage=server.stage, microbatch=mb, shape=shape, tensor=data, seed=seed, samples=samples)
        self.router.started(server)
        start = self.clock()
        timeout_s = self.pipe.call_timeout_s if patient else self.router.deadline_s(server)
        try:
            reply = await self.client.call(server.endpoint, method, call, timeout_s=timeout_s)
            out = self.codec.decode(reply.shape, reply.tensor, what=f"{method} reply of {server.peer_id}")
            if tuple(out.shape) != tuple(x.shape):
                raise BadActivation(f"{method} reply of {server.peer_id} has shape {tuple(out.shape)}, "
                                    f"not {tuple(x.shape)}")
        except RpcRejected as e:
            if e.code in _CONTEXT_GONE:  # the server answered: it is alive and well
                self.router.answered(server, self.clock() - start)
            else:
                self.router.failed(server)
            raise
        except (RpcError, BadActivation):
            self.router.failed(server)
            raise
        self.router.answered(server, self.clock() - start, queue=reply.queue)
        return out

    def _attempts(self, stage: int) -> int:
        return 2 * max(1, len(self.router.servers(stage))) + 1

    async def _next(self, stage: int, tried: set[Server], late: set[Server]) -> tuple[Server, bool]:
        """A server of `stage` not tried yet for this call, and whether to give it the whole
        `pipeline.call_timeout_s`. When every listed one was tried, one that only passed its adaptive deadline
        (in `late`, still listed) is called once more with that whole time: a server slow for a moment is not
        dead, and with no other server to send to, giving up on it would lose the micro-batch. Else the list
        is read again until it names another (one restarted, or new) for up to `listed_wait_s`; while it lists
        none (a lost stage, being taken), for up to `pipeline.stage_wait_s`."""
        server = self.router.choose(stage, exclude=tried)
        if server is None:
            listed = self.router.servers(stage)
            slow = next((s for s in listed if s in late), None)
            if slow is not None:
                late.discard(slow)
                return slow, True
        start = self.clock()
        while server is None:
            self.router.update(self.servers(), hints=self.hints())
            server = self.router.choose(stage, exclude=tried)
            if server is None:
                n_listed = len(self.router.servers(stage))
                what, limit_s = (("pipeline.call_timeout_s or discovery.record_ttl_s + heartbeat_s", self.listed_wait_s)
                                 if n_listed else ("pipeline.stage_wait_s", self.pipe.stage_wait_s))
                if self.clock() - start >= limit_s:
                    raise StageLost(f"stage {stage}: no server answered within {limit_s:g} s ({what}; {n_listed} "
                                    f"listed, {len(tried)} failed this call)")
                await asyncio.sleep(_LIST_POLL_S)
        return server, False

    async def _forward(self, stage: int, mb: str, x: torch.Tensor, seed: int,
                       tally: _Tally) -> tuple[torch.Tensor, Server]:
        tried: set[Server] = set()
        late: set[Server] = set()  # those of `tried` that only passed their adaptive deadline
        reasons = []
        for _attempt in range(self._attempts(stage)):
            try:
                server, patient = await self._next(stage, tried, late)
            except StageLost as e:
                reasons.append(str(e))
                break
            start = self.clock()
            try:
                y = await self._call(server, "Forward", mb, x, seed=seed, patient=patient)
            except (RpcError, BadActivation) as e:
                tried.add(server)
                if isinstance(e, RpcTimeout) and not patient:
                    late.add(server)
                reasons.append(f"{server.peer_id}: {e}")
                tally.rerouted += 1  # sent again to another server, or lost
                continue
            tally.seconds[stage].append(self.clock() - start)
            return y, server
        raise StageLost(f"micro-batch {mb} lost at stage {stage}: {'; '.join(reasons) or 'no server'}")

    async def _backward(self, stage: int, mb: str, x: torch.Tensor, grad: torch.Tensor, server: Server, seed: int,
                        samples: int, tally: _Tally) -> torch.Tensor:
        start = self.clock()
        late: set[Server] = set()  # servers that only passed their adaptive deadline: see _next
        try:
            out = await self._call(server, "Backward", mb, grad, samples=samples)
            tally.seconds[stage].append(self.clock() - start)
            return out
        except RpcRejected as e:
            alive = e.code in _CONTEXT_GONE  # the server is fine, the micro-batch's input there is not
            reasons = [f"{server.peer_id}: {e}"]
        except (RpcError, BadActivation) as e:
            alive = False
            reasons = [f"{server.peer_id}: {e}"]
            if isinstance(e, RpcTimeout):
                late.add(server)
        tally.rerouted += 1
        # The stage's forward again, then the backward, on one server (the same one if it is alive).
        tried: set[Server] = set() if alive else {server}
        for attempt in range(self._attempts(stage)):
            try:
                other, patient = await self._next(stage, tried, late)
            except StageLost as e:
                reasons.append(str(e))
                break
            again = f"{mb}/{stage}.{attempt}"
            try:
                await self._call(other, "Forward", again, x, seed=seed, patient=patient)
                return await self._call(other, "Backward", again, grad, samples=samples, patient=patient)
            except (RpcError, BadActivation) as e:
                tried.add(other)
                if isinstance(e, RpcTimeout) and not patient:
                    late.add(other)
                reasons.append(f"{other.peer_id}: {e}")
        raise StageLost(f"micro-batch {mb} lost in the backward of stage {stage}: {'; '.join(reasons)}")
