"""NetworkAverager: one peer's side of a scope's rounds on an RpcNode: its reducer, its voter, its proposer and
learner, the material it holds, wired to the gRPC transports; and a blocking facade for callers that hand it a
group (benchmarks, tests, local islands).

Everything here lives on the node's event loop; `NetworkPlane` (peer/network.py) awaits it from the peer's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from swarmtrain.averaging.aggregate import Aggregation
from swarmtrain.averaging.allreduce import AllReduce
from swarmtrain.averaging.deciding import Decider
from swarmtrain.averaging.fetching import MaterialFetcher
from swarmtrain.averaging.material import MaterialStore, check_shard
from swarmtrain.averaging.reducer import ReducerRegistry, max_encoded_bytes
from swarmtrain.averaging.rounds import Electorate, Preview, RoundAverager
from swarmtrain.averaging.transport import GrpcReduceTransport
from swarmtrain.averaging.voting import CheckResult, VoterService
from swarmtrain.compress import Codec
from swarmtrain.config import AveragingConfig
from swarmtrain.diloco.averager import AverageResult, Delta
from swarmtrain.discovery import PeerRecord
from swarmtrain.round.ballots import Voter
from swarmtrain.round.group import Group
from swarmtrain.round.messages import ConsensusTransport, Contact
from swarmtrain.rpc.averaging_client import AveragingClient
from swarmtrain.rpc.averaging_wire import serve_averaging
from swarmtrain.rpc.consensus_wire import GrpcConsensusTransport, serve_consensus
from swarmtrain.rpc.errors import RpcError, RpcRejected, RpcUnavailable
from swarmtrain.rpc.node import RpcNode
from swarmtrain.sync.votes import FileVoteStore, MemoryVoteStore, VoteStore
from swarmtrain.trust.identity import Identity, KeyBinding, verifier

__all__ = ["GroupProvider", "NetworkAverager"]

log = logging.getLogger(__name__)

ANY_SIZE_BYTES = 1 << 34  # what a facade built without a size fetches of a value's material at most
# Returns round r's group (this peer among its members), or None when no group formed.
GroupProvider = Callable[[int], Group | None]


class NetworkAverager:
    """A scope's reducer, voter and proposer on `node`. Construct before `node.start()` (it registers the
    Averaging and Consensus services unless the node is client-mode).

    `votes_dir` keeps the voter's votes and the material it accepted on disk (the checkpoint directory);
    without it they live in memory and the voter is a new incarnation at every start. `numel` is the part's
    size (values of another size are refused); 0 takes any size (a facade whose callers pick the size)."""

    def __init__(self, node: RpcNode, *, run_id: str, run_nonce: str = "", codec: Codec, cfg: AveragingConfig,
                 identity: Identity, key_binding: KeyBinding, numel: int, scope: str = "",
                 votes_dir: str | Path | None = None, round_now: Callable[[], int] | None = None,
                 check_result: CheckResult | None = None, group_provider: GroupProvider | None = None,
                 incarnation: int | None = None) -> None:
        """`incarnation` fixes the voter's first incarnation without `votes_dir` (fixed groups of tests and
        benchmarks, whose members are all incarnation 0)."""
        self.node = node
        self.run_id = run_id
        self.scope = scope
        self.cfg = cfg
        self.codec = codec
        self.group_provider = group_provider
        self.run = f"{run_id}/{run_nonce}"
        self._reported: tuple[int, int] = (0, 0)  # node counter totals at the last reported result
        self._facade_round = 0  # the newest round `average` was asked for: a facade's part round
        if round_now is None:
            round_now = lambda: self._facade_round  # noqa: E731
        self.registry = ReducerRegistry(peer_id=node.peer_id, run_id=run_id, codec=codec,
                                        window_s=cfg.contribution_window_s, open_wait_s=cfg.allreduce_timeout_s,
                                        buffers=node.buffers,
                                        aggregation=Aggregation(cfg.aggregator, cfg.trim,
                                                                gather=cfg.gathers(codec.name)))
        client = AveragingClient(node)
        self.allreduce = AllReduce(GrpcReduceTransport(client, self.registry, peer_id=node.peer_id), self.registry,
                                   peer_id=node.peer_id, codec=codec, cfg=cfg, buffers=node.buffers)
        self.registry.standins.fetch_contribution = self.allreduce.fetch_contribution
        self.materials = MaterialStore(spill_dir=votes_dir, scope=scope)
        transport = GrpcConsensusTransport(node, local=lambda: {self.scope: self.voter})
        self.consensus = transport
        self.fetcher = MaterialFetcher(transport=transport, store=self.materials, scope=scope, self_id=node.peer_id,
                                       check=lambda layout, j, blob: check_shard(codec, layout, j, blob),
                                       max_bytes=max_encoded_bytes(numel) + (numel // 1024 + 1) * 64
                                       if numel else ANY_SIZE_BYTES)
        store: VoteStore = FileVoteStore(votes_dir) if votes_dir else MemoryVoteStore(incarnation=incarnation)
        self.voter = VoterService(scope=scope, run=self.run, identity=identity, store=store, materials=self.materials,
                                  fetcher=self.fetcher, round_now=round_now, numel=numel, codec=codec.name,
                                  check_result=check_result, offload=votes_dir is not None)  # a memory store: no fsync
        self.decider = Decider(transport=transport, run=self.run, scope=scope,
                               me=Contact(node.peer_id, ""), verify=verifier(key_binding), materials=self.materials,
                               fetcher=self.fetcher)
        self.averager = RoundAverager(allreduce=self.allreduce, voter=self.voter, decider=self.decider,
                                      materials=self.materials, codec=codec, scope=scope,
                                      decision_timeout_s=2 * node.cfg.call_timeout_s)
        if node.serve:
            serve_averaging(node, self.registry)
            serve_consensus(node, lambda: {self.scope: self.voter})

    async def reachable(self, record: PeerRecord) -> bool | None:
        """Matchmaking's `probe` (`reachable`)."""
        return await reachable(self.consensus, record, scope=self.scope, timeout_s=self.node.cfg.call_timeout_s)

    def started(self) -> None:
        """The node listens: this peer's proposals name its endpoint as the holder of their material."""
        self.decider.me = Contact(self.node.peer_id, self.node.endpoint)

    def unreported_bytes(self) -> tuple[int, int]:
        """(sent, received) data-plane bytes since the last `average` result (for the leave line)."""
        sent, received = self.node.counters.totals()
        return sent - self._reported[0], received - self._reported[1]

    def take_bytes(self) -> tuple[int, int]:
        """(sent, received) since the last call: what the round just ended moved."""
        sent0, received0 = self._reported
        sent1, received1 = self._reported = self.node.counters.totals()
        return sent1 - sent0, received1 - received0

    # ------------------------------------------------------------------ on the node's loop

    async def average_async(self, group: Group, delta: Delta, *, base: str, electorate: Electorate,
                            preview: Preview | None) -> AverageResult:
        deadline = asyncio.get_running_loop().time() + self.cfg.allreduce_timeout_s
        return await self.averager.average(group, delta, base=base, electorate=electorate, deadline=deadline,
                                           preview=preview)

    def close(self) -> None:
        """After the node closed: finish the voter's queued writes and stop its writer thread."""
        self.voter.close()

    def drain(self, *, timeout_s: float) -> tuple[str, ...]:
        """Blocking `drain_async`."""
        if not self.node.serve:
            return ()
        return self.node.run(self.drain_async(timeout_s=timeout_s), timeout_s=timeout_s + 5.0)

    async def drain_async(self, *, timeout_s: float) -> tuple[str, ...]:
        """Before leaving: wait until the members of the last served round have pulled this peer's means."""
        if not self.node.serve:
            return ()
        missing = await self.registry.drain(timeout_s=timeout_s)
        if missing:
            log.warning("%s: leaving before %s pulled the means it reduced", self.node.peer_id, list(missing))
        return missing

    # ------------------------------------------------------------------ a blocking facade

    def average(self, round_index: int, delta: Delta, *, voters: Sequence[Voter] | None = None) -> AverageResult:
        """The group's mean of `delta` in round `round_index` (flat fp32, or read a slice at a time), decided by
        `voters` (default: the group's reducers, as a scope's genesis would name them). Blocking."""
        if isinstance(delta, torch.Tensor) and (delta.dim() != 1 or delta.dtype != torch.float32):
            raise ValueError(f"average: delta must be a flat float32 tensor, got {delta.dtype} {tuple(delta.shape)}")
        if self.group_provider is None:
            raise ValueError("average: this averager was built without a group provider")
        self._facade_round = max(self._facade_round, round_index)
        group = self.group_provider(round_index)
        if group is None:
            return AverageResult(round_index, False, None, reason="no group formed for this round")
        if group.round != round_index or group.run_id != self.run_id:
            raise ValueError(f"average: group is for run {group.run_id!r} round {group.round}, expected run "
                             f"{self.run_id!r} round {round_index}")
        me = group.members[group.index_of(self.node.peer_id)]
        if not me.client_mode and not self.node.serve:
            raise ValueError(f"average: {me.peer_id} is a reducer in the group but its RpcNode does not serve")
        chosen = tuple(voters) if voters is not None else tuple(Voter(m.peer_id, m.incarnation) for m in group.reducers)
        electorate = Electorate(chosen, {}, {m.peer_id: Contact(m.peer_id, m.endpoint) for m in group.members})
        timeout_s = self.cfg.allreduce_timeout_s + 4 * self.node.cfg.call_timeout_s
        self.decider.me = Contact(self.node.peer_id, self.node.endpoint)

        try:
            result = self.node.run(self.average_async(group, delta, base="", electorate=electorate, preview=None),
                                   timeout_s=timeout_s + 5.0)
        except TimeoutError as e:
            result = AverageResult(round_index, False, None, tuple(m.peer_id for m in group.members),
                                   reason=f"deadline: {e}")
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            result = AverageResult(round_index, False, None, tuple(m.peer_id for m in group.members),
                                   reason="the all-reduce was cancelled (this peer's rpc node is closing)")
        if result.committed:  # the facade's part is at the next round: what is far behind goes
            with contextlib.suppress(Exception):
                self.node.run(self.voter.advanced(round_index + 1), timeout_s=self.node.cfg.call_timeout_s)
        sent, received = self.take_bytes()
        return dataclasses.replace(result, bytes_sent=sent, bytes_received=received)


async def reachable(transport: ConsensusTransport, record: PeerRecord, *, scope: str, timeout_s: float) -> bool | None:
    """Whether `record`'s process answers a call (matchmaking's `probe`): any reply to a Learn for the round before
    the one it announces will do, a refusal too; False when no process is there, None when the call timed out."""
    try:
        await transport.learn(Contact(record.peer_id, record.endpoint), scope=scope,
                              round_index=max(0, record.round - 1), timeout_s=timeout_s)
    except RpcUnavailable:
        return False
    except RpcRejected:
        return True
    except (RpcError, TimeoutError):
        return None
    return True
