"""A stage server on the data plane: the Pipeline service's handler around a StageServer.

It measures what rebalancing reads from the server's record: the compute seconds of a micro-batch
(forward + backward, EWMAs) and the fraction of a window the compute thread was busy. A handler whose
server moved to another stage (`leave`) refuses new forwards (WrongStage: the trainer re-sends them to
another server of the stage) and still answers the backwards of the forwards it ran.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import time
from collections.abc import Callable

import torch

from swarmtrain.pipeline.errors import PipelineError, WrongStage
from swarmtrain.pipeline.server import StageServer
from swarmtrain.pipeline.tensors import TensorCodec
from swarmtrain.rpc.errors import Rejected
from swarmtrain.rpc.node import RpcNode
from swarmtrain.rpc.pipeline_wire import serve_pipeline
from swarmtrain.wire import pipeline_pb2 as pb

__all__ = ["StageHandler", "serve_stage"]

_KINDS = {"INVALID_ARGUMENT": "invalid", "FAILED_PRECONDITION": "precondition", "NOT_FOUND": "not_found",
          "ABORTED": "aborted", "UNAVAILABLE": "precondition"}


_EWMA = 0.3
_MAX_SPANS = 4096  # compute spans kept for the busy fraction


class StageHandler:
    """The Pipeline service's handler; `latency_s` (EWMA of a call's seconds here), `waiting` (calls in
    the handler), `service_s` and `busy()` go into the server's record."""

    def __init__(self, server: StageServer, codec: TensorCodec, *, peer_id: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self.codec = codec
        self.peer_id = peer_id
        self.clock = clock
        self.left = ""  # why new forwards are refused (this server moved); "" = serving
        self.forward_s = self.backward_s = 0.0  # compute seconds per call (EWMAs); 0 = none yet
        self._spans: collections.deque[tuple[float, float]] = collections.deque(maxlen=_MAX_SPANS)  # (start, end)
        # One compute thread: the server runs one call at a time anyway, and torch's buffers then come from
        # one malloc arena instead of one per executor thread (measured: ~0.3-0.5 GB less peak RSS).
        self._compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self.waiting = 0  # calls in this handler: the queue a reply reports
        self.latency_s = 0.0

    def close(self) -> None:
        """Stop the compute thread (after the node stopped serving)."""
        self._compute.shutdown(wait=True, cancel_futures=True)

    def leave(self, why: str) -> None:
        """Refuse new forwards from now on (WrongStage, saying `why`); backwards are still answered."""
        self.left = why

    @property
    def service_s(self) -> float:
        """Compute seconds of one micro-batch here, forward + backward; 0 until both were measured."""
        return self.forward_s + self.backward_s if self.forward_s and self.backward_s else 0.0

    def busy(self, window_s: float) -> float:
        """The fraction of the last `window_s` seconds the compute thread spent on calls."""
        now = self.clock()
        start = now - window_s
        spans = list(self._spans)  # appended from the compute thread
        total = sum(min(end, now) - max(begin, start) for begin, end in spans if end > start)
        return min(max(total / window_s, 0.0), 1.0)

    def _timed(self, method: str, caller: str, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`work` on the compute thread, its seconds measured."""
        begin = self.clock()
        try:
            out = work()
        finally:
            end = self.clock()
            self._spans.append((begin, end))
        took = end - begin
        if method == "Forward":
            self.forward_s = took if not self.forward_s else (1 - _EWMA) * self.forward_s + _EWMA * took
        else:
            self.backward_s = took if not self.backward_s else (1 - _EWMA) * self.backward_s + _EWMA * took
        return out

    async def __call__(self, method: str, caller: str, call: pb.StageCall) -> pb.StageReply:
        self.waiting += 1
        start = time.monotonic()
        try:
            if method == "Forward" and self.left:
                self.server.refused += 1
                raise WrongStage(f"forward for stage {call.stage}: {self.left}")
            what = "forward input" if method == "Forward" else "backward gradient"
            tensor = self.codec.decode(call.shape, call.tensor, what=what)
            key = f"{caller}\0{call.microbatch}"  # a caller's micro-batch ids are its own
            loop = asyncio.get_running_loop()
            if method == "Forward":
                work = functools.partial(self.server.forward, call.stage, key, tensor, seed=call.seed)
            else:
                work = functools.partial(self.server.backward, call.stage, key, tensor, samples=call.samples)
            out = await loop.run_in_executor(self._compute, self._timed, method, caller, work)
            shape, data = self.codec.encode(out)
            took = time.monotonic() - start
            self.latency_s = took if not self.latency_s else (1 - _EWMA) * self.latency_s + _EWMA * took
            return pb.StageReply(shape=shape, tensor=data, queue=self.waiting - 1, step=self.server.step)
        except PipelineError as e:
            raise Rejected(str(e), kind=_KINDS[e.code]) from None
        finally:
            self.waiting -= 1


def serve_stage(node: RpcNode, server: StageServer, *, codec: TensorCodec) -> StageHandler:
    """Serve `server`'s stage on `node` (before `node.start()`)."""
    handler = StageHandler(server, codec, peer_id=node.peer_id)
    serve_pipeline(node, handler, max_bytes=codec.max_bytes, max_uploads=server.cfg.max_contexts)
    return handler
