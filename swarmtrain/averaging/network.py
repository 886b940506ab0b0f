"""NetworkAverager: the Averager protocol over the gRPC butterfly all-reduce (a blocking facade)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from swarmtrain.averaging.aggregate import Aggregation
from swarmtrain.averaging.allreduce import AllReduce
from swarmtrain.averaging.ballot import VoteBook
from swarmtrain.averaging.group import Group
from swarmtrain.averaging.protocol import AverageResult, Delta
from swarmtrain.averaging.reducer import ReducerRegistry
from swarmtrain.compress import Codec
from swarmtrain.config import AveragingConfig
from swarmtrain.rpc.averaging_wire import serve_averaging
from swarmtrain.rpc.faults import FaultHook
from swarmtrain.rpc.node import RpcNode

__all__ = ["GroupProvider", "NetworkAverager"]

log = logging.getLogger(__name__)

# Returns round r's group (this peer among its members), or None when no group formed.
# Called on the averaging caller's thread; it may block (matchmaking) but must honour its own deadline.
GroupProvider = Callable[[int], Group | None]


class NetworkAverager:
    """Averages one flat fp32 pseudo-gradient per round with the round's group.

    Construct it before `node.start()` (it registers the Averaging service unless the node is
    client-mode). `average()` blocks until the round commits or aborts, at most
    `averaging.allreduce_timeout_s` after its group is known.
    """

    def __init__(self, node: RpcNode, *, run_id: str, group_provider: GroupProvider, codec: Codec,
                 cfg: AveragingConfig, fault_hook: FaultHook | None = None, votes: VoteBook | None = None) -> None:
        self.node = node
        self.run_id = run_id
        self.group_provider = group_provider
        self.cfg = cfg
        self._reported: tuple[int, int] = (0, 0)  # node counter totals at the last reported result
        self.registry = ReducerRegistry(peer_id=node.peer_id, run_id=run_id, codec=codec,
                                        window_s=cfg.contribution_window_s, open_wait_s=cfg.allreduce_timeout_s,
                                        fault_hook=fault_hook, buffers=node.buffers, votes=votes,
                                        aggregation=Aggregation(cfg.aggregator, cfg.trim,
                                                                    gather=cfg.gathers(codec.name)))
        self.allreduce = AllReduce(node, self.registry, codec=codec, cfg=cfg, fault_hook=fault_hook)
        if node.serve:
            serve_averaging(node, self.registry)

    def unreported_bytes(self) -> tuple[int, int]:
        """(sent, received) data-plane bytes since the last `average` result (for the leave line)."""
        sent, received = self.node.counters.totals()
        return sent - self._reported[0], received - self._reported[1]

    def drain(self, *, timeout_s: float) -> tuple[str, ...]:
        """Before leaving: wait until the members of the last served round have pulled this peer's means."""
        if not self.node.serve:
            return ()
        missing = self.node.run(self.registry.drain(timeout_s=timeout_s), timeout_s=timeout_s + 5.0)
        if missing:
            log.warning("%s: leaving before %s pulled the means it reduced", self.node.peer_id, list(missing))
        return missing

    def average(self, round_index: int, delta: Delta, *, electorate: tuple[str, ...] = ()) -> AverageResult:
        """The Averager protocol: the group's mean of `delta` (flat fp32, or read a slice at a time) for round
        `round_index`.

        `electorate`: the members of the commit that produced this peer's θ_global (see allreduce.py)."""
        if isinstance(delta, torch.Tensor) and (delta.dim() != 1 or delta.dtype != torch.float32):
            raise ValueError(f"average: delta must be a flat float32 tensor, got {delta.dtype} {tuple(delta.shape)}")
        group = self.group_provider(round_index)
        if group is None:
            return AverageResult(round_index, False, None, reason="no group formed for this round")
        if group.round != round_index or group.run_id != self.run_id:
            raise ValueError(f"average: group is for run {group.run_id!r} round {group.round}, expected run "
                             f"{self.run_id!r} round {round_index}")
        me = group.members[group.index_of(self.node.peer_id)]
        if not me.client_mode and not self.node.serve:
            raise ValueError(f"average: {me.peer_id} is a reducer in the group but its RpcNode does not serve")
        # Bytes moved since the previous call (means served to slow members, state served to joiners)
        # count towards this round: they are on the wire too, and nothing else reports them.
        sent0, received0 = self._reported
        timeout_s = self.cfg.allreduce_timeout_s
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        try:
            result = self.node.run(self.allreduce.run(group, delta, deadline=deadline,
                                                      electorate=electorate), timeout_s=timeout_s + 5.0)
        except TimeoutError as e:
            result = AverageResult(round_index, False, None, tuple(m.peer_id for m in group.members),
                                   reason=f"deadline: {e}")
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            # The node's loop cancelled the round (it is closing): an abort, never an exception for the caller.
            result = AverageResult(round_index, False, None, tuple(m.peer_id for m in group.members),
                                   reason="the all-reduce was cancelled (this peer's rpc node is closing)")
        sent1, received1 = self._reported = self.node.counters.totals()
        log.info("%s: round %d %s in %.3fs (sent %d B, received %d B)", self.node.peer_id, round_index,
                 "committed" if result.committed else "aborted", time.monotonic() - started, sent1 - sent0,
                 received1 - received0)
        return dataclasses.replace(result, bytes_sent=sent1 - sent0, bytes_received=received1 - received0)
