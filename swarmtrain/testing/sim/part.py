"""The simulation tester's part: a small θ_global with the real outer optimizer, a seeded Δ per round after a
(virtual) stretch of inner steps (cut to end with the swarm's after a heal into a round under way, and announced
in the record as a worker's), and real checkpoints in the peer's directory (every `checkpoint_every`
rounds, as a worker takes them). Every commit and heal is written to the simulation's ledger, which the
checker reads: one state per round, whoever holds it.

Only a restart reads a peer's directory, so the checkpoints it takes are written when its process dies
(`flush`, from SimPeer.crash): the newest `CHECKPOINTS_KEPT` of them, oldest first, as they were taken, which
leaves the directory holding what writing each at once would have left there. A swarm's every peer writing
its checkpoint (certificates of every voter) at every round took 6-8% of a simulation's time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarmtrain.config import OuterConfig
from swarmtrain.diloco.averager import AverageResult, Previews, ShardedMean
from swarmtrain.diloco.flat import combine_digest, state_digest
from swarmtrain.diloco.outer import OuterOptimizer
from swarmtrain.driver.part import CommittedState, Trained
from swarmtrain.round.ballots import Voter, voters_from_json, voters_to_json
from swarmtrain.round.certificate import Certificate
from swarmtrain.sync.checkpoint import load_latest_checkpoint, save_checkpoint

__all__ = ["CHECKPOINTS_KEPT", "Ledger", "SimPart"]

CHECKPOINTS_KEPT = 2  # as a worker keeps them


@dataclass
class Ledger:
    """What every peer committed and adopted, for the checker (safety: one state digest per round)."""

    commits: list[tuple[float, str, int, str, str]] = field(default_factory=list)  # (t, peer, round, value, digest)
    states: dict[int, set[str]] = field(default_factory=dict)  # round -> digests of states held at it
    heals: list[tuple[float, str, int, str]] = field(default_factory=list)  # (t, peer, round, digest)
    attempts: list[tuple[float, str, int, bool, str]] = field(default_factory=list)  # (t, peer, round, committed, why)

    def held(self, round_index: int, digest: str) -> None:
        self.states.setdefault(round_index, set()).add(digest)


class SimPart:
    """See the module docstring. `directory` is the peer's disk (what survives a crash)."""

    def __init__(self, *, peer_id: str, numel: int, outer: OuterConfig, directory: Path, seed: int,
                 train_s: float, ledger: Ledger, checkpoint_every: int = 1,
                 now: Callable[[], float] = lambda: 0.0) -> None:
        """`now`: the swarm clock its record's round end is on."""
        self.peer_id = peer_id
        self.numel = numel
        self.outer_cfg = outer
        self.directory = directory
        self.seed = seed
        self.train_s = train_s
        self.ledger = ledger
        self.checkpoint_every = checkpoint_every
        self.now = now
        self.round_ends_at = 0.0  # swarm clock: when its inner steps of its round end, as a worker announces it
        self.join_by: tuple[int, float] | None = None  # (round healed into, swarm time the swarm's steps end)
        self.theta = torch.zeros(numel)
        self.outer = OuterOptimizer(outer, numel=numel)
        self._round = 0
        self._voters: tuple[Voter, ...] = ()
        self.certificates: list[Certificate] = []
        self.saved: list[int] = []
        # Checkpoints taken and not written yet (`flush`), oldest first: tensors, round, voters, certificates.
        self._unwritten: list[tuple[dict[str, torch.Tensor], int, tuple[Voter, ...], tuple[Certificate, ...]]] = []
        self.version = 0
        self.trained_rounds = 0
        self._digest = ""
        self._previews = Previews()  # as a worker's: a named mean previewed once per state
        self._resume()

    # ------------------------------------------------------------------ state

    def _resume(self) -> None:
        loaded = load_latest_checkpoint(self.directory)
        if loaded is not None:
            self.theta.copy_(loaded.tensors["theta"])
            self.outer.load_state_tensors({k[len("outer."):]: v for k, v in loaded.tensors.items()
                                           if k.startswith("outer.")})
            self._round = int(loaded.meta["round"])
            self._voters = voters_from_json(loaded.meta["voters"])
            self.certificates = [Certificate.from_json(c) for c in loaded.meta["certificates"]]
        self._rehash()

    def _rehash(self) -> None:
        self._digest = state_digest(self._round, self.theta, self.outer.momentum_buffer, self._voters)
        self.version += 1
        self.ledger.held(self._round, self._digest)

    def _checkpoint(self) -> None:
        """Take a checkpoint of the state now; it reaches the directory at `flush` (see the module docstring)."""
        tensors = {"theta": self.theta.clone(),
                   **{f"outer.{k}": v.clone() for k, v in self.outer.state_tensors().items()}}
        taken = (tensors, self._round, self._voters, tuple(self.certificates[-4:]))
        self._unwritten = [*self._unwritten[1 - CHECKPOINTS_KEPT:], taken]
        self.saved = [*self.saved[1 - CHECKPOINTS_KEPT:], self._round]  # the rounds of those kept, oldest first

    def flush(self) -> None:
        """Write the checkpoints taken since the last flush (the newest CHECKPOINTS_KEPT, oldest first)."""
        unwritten, self._unwritten = self._unwritten, []
        for tensors, round_index, voters, certificates in unwritten:
            meta = {"round": round_index, "voters": voters_to_json(voters),
                    "certificates": [c.to_json() for c in certificates]}
            save_checkpoint(self.directory, tensors=tensors, meta=json.loads(json.dumps(meta)),
                            keep=CHECKPOINTS_KEPT)

    def replay_from(self) -> int:
        return self.saved[0] if self.saved else self._round

    @property
    def round(self) -> int:
        return self._round

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def voters(self) -> tuple[Voter, ...]:
        return self._voters

    # ------------------------------------------------------------------ the Part protocol

    async def train(self, stop: asyncio.Event) -> Trained | None:
        train_s = self.train_s
        join, self.join_by = self.join_by, None
        if join is not None and join[0] == self._round:  # healed into a round under way: end with the swarm
            train_s = min(train_s, max(0.0, join[1] - self.now()))
        self.round_ends_at = self.now() + train_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=train_s)
        if stop.is_set():
            return None
        self.trained_rounds += 1
        h = hashlib.sha256(f"{self.seed}|{self.peer_id}|{self._round}|{self.trained_rounds}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
        delta = torch.randn(self.numel, generator=g) * 0.01 + 0.001 * self._round
        return Trained(round=self._round, delta=delta, loss=float(delta.abs().mean()), compute_s=train_s,
                       steps=4)

    async def delta_problem(self, trained: Trained) -> str:
        return ""

    async def preview(self, mean: ShardedMean, next_voters: tuple[Voter, ...]) -> str:
        ht, hm = self._previews.get(self.version, mean, lambda: self.outer.preview_pieces(self.theta, mean.pieces))
        return combine_digest(self._round + 1, self.numel, ht, hm, next_voters)

    async def apply(self, result: AverageResult, *, own: Trained | None, comm_s: float = 0.0) -> None:
        assert result.committed and result.certificate is not None and isinstance(result.mean, ShardedMean)
        value = result.certificate.value
        if value.round != self._round or value.base != self._digest:
            raise AssertionError(f"{self.peer_id}: applying round {value.round} (base {value.base[:12]}) to round "
                                 f"{self._round} (state {self._digest[:12]})")
        self.outer.step_pieces(self.theta, result.mean.pieces)
        self._round += 1
        self._voters = value.next_voters
        self.certificates = [*self.certificates[-7:], result.certificate]
        self._rehash()
        if self._digest != value.result:
            raise AssertionError(f"{self.peer_id}: round {value.round}'s commit gave state {self._digest[:12]}, its "
                                 f"value names {value.result[:12]}")
        loop_t = asyncio.get_running_loop().time()
        self.ledger.commits.append((loop_t, self.peer_id, value.round, value.value_id, self._digest))
        if self._round % self.checkpoint_every == 0:
            self._checkpoint()

    async def adopt(self, state: CommittedState, *, keep_progress: bool = False) -> None:
        self.theta.copy_(state.theta_global)
        self.outer.load_state_tensors({} if state.outer_momentum is None else {"momentum": state.outer_momentum})
        self._round, self._voters = state.round, state.voters
        self.certificates = list(state.certificates)
        self._rehash()
        if self._digest != state.digest:
            raise AssertionError(f"{self.peer_id}: adopted a state of digest {self._digest[:12]}, announced "
                                 f"{state.digest[:12]}")
        self.ledger.heals.append((asyncio.get_running_loop().time(), self.peer_id, self._round, self._digest))
        self._checkpoint()

    async def resync(self, reason: str) -> None:
        return None

    def joined(self, round_index: int, round_ends_at: float | None) -> None:
        """Healed into a round under way: its steps end with the swarm's, as a worker's do."""
        self.join_by = None if round_ends_at is None else (round_index, round_ends_at)

    async def report(self, trained: Trained | None, result: AverageResult, *, comm_s: float) -> None:
        self.ledger.attempts.append((asyncio.get_running_loop().time(), self.peer_id,
                                     trained.round if trained else self._round, result.committed, result.reason[:120]))

    @contextlib.contextmanager
    def committed(self) -> Iterator[CommittedState]:
        yield CommittedState(self._round, self.theta, self.outer.momentum_buffer, self._voters, self._digest,
                             tuple(self.certificates[-4:]), self.version)
