"""A few NetworkAverager peers in one process on loopback with a fixed Group (shared by the all-reduce tests)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import torch

from swarmtrain.averaging.aggregate import mean_of
from swarmtrain.averaging.network import NetworkAverager
from swarmtrain.compress import get_codec
from swarmtrain.config import AveragingConfig, RpcConfig
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.discovery import InMemoryRegistry
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.faults import FaultHook
from swarmtrain.rpc.node import RpcNode
from swarmtrain.testing.faults import inject_faults
from swarmtrain.trust.identity import registry_binding

RUN_ID = "test-run"
RPC = RpcConfig(run_key="secret", call_timeout_s=5.0, chunk_bytes=4096, max_message_bytes=1 << 20, retries=2,
                backoff_s=0.01)
# Windows wide enough for a loaded 2-core CI box; the "late" fault below is far outside them.
AVG = AveragingConfig(min_peers=2, allreduce_timeout_s=10.0, contribution_window_s=1.0, max_retries=1)


class Swarm:
    """`names` peers; `client_mode` names those that only dial out; `rpc` overrides RPC per peer.
    Use as a context manager."""

    def __init__(self, names: Sequence[str], *, client_mode: Sequence[str] = (), fault_hook: FaultHook | None = None,
                 avg: AveragingConfig = AVG, codec: str = "fp32", bandwidth: dict[str, float] | None = None,
                 rpc: dict[str, RpcConfig] | None = None, codec_options: dict[str, object] | None = None) -> None:
        self.names = sorted(names)
        rpc = rpc or {}
        self.nodes = {n: RpcNode(rpc.get(n, RPC), peer_id=n, serve=n not in client_mode) for n in self.names}
        keys = InMemoryRegistry()  # the peers' identity keys (what their voters sign with)
        self.averagers = {n: NetworkAverager(self.nodes[n], run_id=RUN_ID, group_provider=self._group,
                                             codec=get_codec(codec, **(codec_options or {})), cfg=avg,
                                             identity=keys.identity(n), key_binding=registry_binding(keys.keys),
                                             numel=0, incarnation=0)
                          for n in self.names}
        if fault_hook is not None:
            for averager in self.averagers.values():
                inject_faults(averager, fault_hook)
        self.client_mode = set(client_mode)
        self.bandwidth = bandwidth or {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.names))

    def __enter__(self) -> Swarm:
        for node in self.nodes.values():
            node.start()
        for averager in self.averagers.values():
            averager.started()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)
        for node in self.nodes.values():
            node.close()

    def _group(self, round_index: int) -> Group:
        members = tuple(Member(n, self.nodes[n].endpoint, n in self.client_mode, self.bandwidth.get(n, 0.0))
                        for n in self.names)
        return Group(RUN_ID, round_index, members)

    def average(self, round_index: int, deltas: dict[str, torch.Tensor]) -> dict[str, AverageResult]:
        """Every peer in `deltas` averages concurrently (one thread each, like separate processes)."""
        futures = {n: self.pool.submit(self.averagers[n].average, round_index, d) for n, d in deltas.items()}
        return {n: f.result(timeout=30) for n, f in futures.items()}


def deltas_for(names: Sequence[str], numel: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(numel, generator=g) for n in sorted(names)}


def reference_mean(deltas: dict[str, torch.Tensor], contributors: Sequence[str], bounds: Sequence[tuple[int, int]],
                   codec: str = "fp32") -> torch.Tensor:
    """What the swarm must produce: per shard, the codec round-trip of each contributor's slice, summed in
    group order in fp32, divided, and round-tripped once more (the reducer's single re-encode)."""
    c = get_codec(codec)
    numel = next(iter(deltas.values())).numel()
    out = torch.empty(numel)
    for lo, hi in bounds:
        parts = [c.decode(c.encode(deltas[p][lo:hi])) for p in contributors]
        out[lo:hi] = c.decode(c.encode(mean_of(parts)))
    return out


def check_rounds(swarm: Swarm, names: Sequence[str], numel: int, count: int) -> None:
    """`count` rounds of every peer in `names`: each commits the exact mean of everyone's Δ."""
    from swarmtrain.averaging.reducer import shard_bounds

    for round_index in range(count):
        deltas = deltas_for(names, numel, seed=round_index)
        results = swarm.average(round_index, deltas)
        expected = reference_mean(deltas, names, shard_bounds(numel, (0.0,) * len(names)))
        for name, r in results.items():
            assert r.committed, f"{name}: {r.reason}"
            assert r.mean is not None and torch.equal(r.mean_tensor(), expected), name
