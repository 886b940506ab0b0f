"""Faults of state transfer, applied from outside the shipped code: a donor's StateTransfer service wrapped so
that, where a FaultPlan says so (site call "state"), its answer is altered as a lying donor, a dying one or a man
in the middle would alter it.

* `corrupt`: bytes in the middle of the served data overwritten, the honest header (and checksum) kept: a donor
  serving other bytes; the joiner's sha256 check refuses it.
* `truncate`: the answer ends a quarter early, as if the donor died mid-stream.
* `forge`: the data altered and the header's sha256 rewritten to match, after the donor's MAC was computed: a
  man in the middle without the run key; the header's MAC refuses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

from swarmtrain.rpc.faults import FaultHook, FaultSite, corrupt, truncate
from swarmtrain.rpc.node import RpcNode, peer_of
from swarmtrain.rpc.state_wire import StateServicer, StateSource, register_state_servicer
from swarmtrain.sync.transfer import StateServer
from swarmtrain.wire import sync_pb2 as pb

__all__ = ["faulty_state_server"]


class _FaultyServicer(StateServicer):
    def __init__(self, node: RpcNode, source: StateSource, faults: FaultHook) -> None:
        super().__init__(node, source)
        self.faults = faults

    async def GetState(self, raw: bytes, context: Any) -> AsyncIterator[pb.StateChunk]:
        chunks = [c async for c in super().GetState(raw, context)]
        if not chunks or not chunks[0].HasField("header"):
            for c in chunks:
                yield c
            return
        header = chunks[0].header
        fault = self.faults(FaultSite(self.node.peer_id, header.round, "state", peer_of(context)))
        if fault is None or fault.action not in ("corrupt", "truncate", "forge"):
            for c in chunks:
                yield c
            return
        sizes = [len(c.data) for c in chunks]
        data = b"".join(c.data for c in chunks)
        data = truncate(data) if fault.action == "truncate" else corrupt(data)
        if fault.action == "forge":
            header.sha256 = hashlib.sha256(data).digest()  # the MAC, under the run key, stays the honest one
        at = 0
        for i, size in enumerate(sizes):
            piece = data[at:at + size]
            at += size
            if i and not piece:
                return  # truncated: the stream ends early
            yield pb.StateChunk(header=header, data=piece) if i == 0 else pb.StateChunk(data=piece)


def faulty_state_server(node: RpcNode, faults: FaultHook, *, hold_s: float = 10.0) -> StateServer:
    """A StateServer on `node` (before `node.start()`) whose answers go through `faults` (the module docstring)."""
    server = StateServer(node, hold_s=hold_s, register=False)
    register_state_servicer(node, _FaultyServicer(node, server, faults))
    return server
