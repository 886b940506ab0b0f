"""A round's group: the members matchmaking agreed on, identical (same order) on every member."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["Group", "Member"]


@dataclass(frozen=True)
class Member:
    """One peer in a round's group, as it announced itself during matchmaking."""

    peer_id: str
    endpoint: str  # host:port of its gRPC server; client-mode peers may leave it empty
    client_mode: bool = False  # behind NAT: dials out only, so it contributes but never reduces
    bandwidth_bytes_per_s: float = 0.0  # measured; sizes its share of shards (0 = unknown)
    steps_per_s: float = 0.0  # its inner-step rate over the round it contributes (0 = unknown; diloco.pace)
    lag_s: float = 0.0  # how long its last committed round's mean took after its Δ, own clock (0 = unknown)
    state_hash: str = ""  # digest of the committed state it averages from; a group's members all announce one
    incarnation: int = 0  # of its voter (round/ballots.py): a contributor votes in the next round as this one


@dataclass(frozen=True)
class Group:
    """Members sorted by peer_id, so every member derives the same shard assignment from it."""

    run_id: str
    round: int
    members: tuple[Member, ...]
    attempt: int = 0  # the matchmaking attempt of the round that formed this group

    def __post_init__(self) -> None:
        ids = [m.peer_id for m in self.members]
        assert ids == sorted(ids), "Group.members must be sorted by peer_id"
        assert len(set(ids)) == len(ids), "Group.members must be unique"

    @property
    def group_id(self) -> str:
        """A digest of (run, round, attempt, members with what they announced) that every message of the round
        carries."""
        h = hashlib.sha256(f"{self.run_id}|{self.round}|{self.attempt}|".encode())
        for m in self.members:
            h.update(f"{m.peer_id}|{m.endpoint}|{int(m.client_mode)}|{m.steps_per_s!r}|{m.lag_s!r}|{m.state_hash}|"
                     f"{m.incarnation};".encode())
        return h.hexdigest()[:32]

    @property
    def reducers(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if not m.client_mode)

    def index_of(self, peer_id: str) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        raise KeyError(f"peer {peer_id} is not in group {self.group_id} of round {self.round}")
