"""Which data a peer reads: its own permutation (an open swarm), or one slot of the run's (`data.num_shards`).

A run with `data.num_shards = K` cuts one permutation of its seed into K disjoint slots; peer k reads
slot k, the windows rank k of a K-rank data-parallel job reads. A peer takes the slot it is given
(`data.shard_index`), else the slot its checkpoint was reading, else the lowest slot no live peer
reads. Peer records carry the slot, so a slot a live peer reads is refused. Best effort: two peers
that start within one heartbeat of each other can both pick the same free slot.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import torch

from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches
from swarmtrain.discovery import Discovery
from swarmtrain.peer.services import PeerError

__all__ = ["choose_shard", "peer_batches", "peer_seed", "saved_slot"]

log = logging.getLogger(__name__)


def peer_seed(run_seed: int, peer_id: str) -> int:
    """A seed of this peer's own (its data order in an open swarm, its codec's and dropout's randomness)."""
    digest = hashlib.sha256(f"{run_seed}|{peer_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")  # ShardedBatches multiplies it by ~1e6 into an int64


def saved_slot(worker_meta: Mapping[str, Any] | None, *, num_shards: int) -> int | None:
    """The slot a checkpoint's worker state was reading, if it read one of `num_shards` slots."""
    data = (worker_meta or {}).get("data")
    if not isinstance(data, Mapping) or data.get("num_workers") != num_shards or num_shards == 0:
        return None
    slot = data.get("worker_index")
    return slot if isinstance(slot, int) and 0 <= slot < num_shards else None


async def choose_shard(cfg: RunConfig, discovery: Discovery, *, saved: int | None) -> RunConfig:
    """`cfg` with the slot this peer reads (unchanged for an unsharded run); refuses a slot already read."""
    data, run_id = cfg.data, cfg.train.run_id
    if data.num_shards == 0:
        if data.shard_index >= 0:
            raise PeerError(f"data.shard_index={data.shard_index} is set, but run {run_id!r} does not shard its "
                            "data (data.num_shards=0): every peer reads its own permutation")
        return cfg
    peers = await discovery.live_peers(timeout_s=cfg.rpc.call_timeout_s)
    taken: dict[int, str] = {}  # slot -> a live peer reading it (not this one: its old record may linger)
    for p in sorted(peers, key=lambda p: p.peer_id):
        if p.peer_id != discovery.peer_id and p.shard_index >= 0:
            taken.setdefault(p.shard_index, p.peer_id)
    slot = data.shard_index if data.shard_index >= 0 else saved
    if slot is None:
        slot = next((k for k in range(data.num_shards) if k not in taken), None)
        if slot is None:
            raise PeerError(f"all {data.num_shards} data shards of run {run_id!r} are read by live peers "
                            "(data.num_shards): wait for one to leave, or run with more shards")
        log.info("reading data shard %d of %d (the lowest no live peer reads)", slot, data.num_shards)
    if slot in taken:
        raise PeerError(f"data shard {slot} of {data.num_shards} is already read by live peer {taken[slot]}: "
                        "start this peer with another --shard-index")
    return cfg.replace(data={"shard_index": slot})


def peer_batches(cfg: RunConfig, train: torch.Tensor, peer_id: str) -> ShardedBatches:
    """This peer's stream, from `data.start_step` (a fresh peer; a checkpoint sets its own position)."""
    data = cfg.data
    if data.num_shards:
        if data.shard_index < 0:
            raise ValueError("a sharded run's stream needs data.shard_index (see choose_shard)")
        slot, slots, seed = data.shard_index, data.num_shards, cfg.train.seed
    else:
        slot, slots, seed = 0, 1, peer_seed(cfg.train.seed, peer_id)
    return ShardedBatches(train, worker_index=slot, num_workers=slots, batch_size=data.batch_size,
                          seq_len=data.seq_len, seed=seed, position=data.start_step)
