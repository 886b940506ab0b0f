"""An in-process averager for K workers in one process: real codec round trips, real byte counts."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from swarmtrain.averaging.aggregate import Aggregation, aggregate_encoded, mean_of_gathered
from swarmtrain.compress.codec import Codec, CodecError
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.traffic import allreduce_bytes_per_peer

__all__ = ["InProcessGroup", "InProcessMember"]


class InProcessGroup:
    """Averages one round's K pseudo-gradients as the swarm's butterfly all-reduce would.

    Every Δ is encoded with `codec`, decoded and combined in fp32 by `aggregation` (the mean by
    default), and the result is encoded once more and decoded (the reducers send the re-encoded mean
    back), so quantization acts exactly where it acts on the wire. A Δ the codec refuses (NaN or Inf)
    is left out, as a reducer refuses it. With `aggregation.gather` every member averages the decoded
    contributions itself, as a gathering round does. Byte counts come from the real encoded sizes (see
    `allreduce_bytes_per_peer`). Sequential drivers call `average_all`; threaded workers each use a
    `member(k)` view, which satisfies the `Averager` protocol.
    """

    def __init__(self, codec: Codec, *, num_workers: int, timeout_s: float = 60.0,
                 aggregation: Aggregation | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.codec = codec
        self.aggregation = aggregation if aggregation is not None else Aggregation()
        self.num_workers = num_workers
        self.peer_ids = tuple(f"worker-{k}" for k in range(num_workers))
        self.timeout_s = timeout_s
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}
        self._results: list[AverageResult] = []
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(num_workers, action=self._reduce_pending)

    def average_all(self, round_index: int, deltas: Sequence[torch.Tensor]) -> list[AverageResult]:
        """The K results (one per worker, same order) of averaging `deltas` in round `round_index`."""
        if len(deltas) != self.num_workers:
            raise ValueError(f"round {round_index}: got {len(deltas)} pseudo-gradients for {self.num_workers} workers")
        shapes = {tuple(d.shape) for d in deltas}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(f"round {round_index}: pseudo-gradients must be flat and equal-sized, "
                             f"got {sorted(shapes)}")
        encoded: list[bytes | None] = []
        for d in deltas:
            try:
                encoded.append(self.codec.encode(d.detach().to(torch.float32).contiguous()))
            except CodecError:
                encoded.append(None)  # refused, as a reducer refuses a contribution holding NaN or Inf
        accepted = [e for e in encoded if e is not None]
        members = tuple(p for p, e in zip(self.peer_ids, encoded, strict=True) if e is not None)
        if not accepted:
            return [AverageResult(round=round_index, committed=False, mean=None, members=(),
                                  reason="every contribution was refused") for _ in deltas]
        numel = deltas[0].numel()
        k = self.num_workers
        total_in = sum(len(e) for e in accepted)
        if self.aggregation.gather:
            mean = mean_of_gathered(self.codec, accepted, out=torch.empty(numel, device=self.codec.device))
            return [
                AverageResult(
                    round=round_index, committed=True, mean=mean, members=members,
                    # shard j of every contribution but the caller's goes from reducer j to the caller: each
                    # contribution crosses the network K − 1 times in all (aggregate.py)
                    bytes_sent=(k * len(e or b"") + (k - 2) * total_in) // k,
                    bytes_received=total_in - len(e or b""),
                )
                for e in encoded
            ]
        if self.aggregation.trimmed(len(accepted)):
            acc = aggregate_encoded(self.codec, accepted, self.aggregation,
                                    out=torch.empty(numel, device=self.codec.device))
        else:  # the mean as simulations always took it (the golden trajectory pins its bits)
            acc = torch.zeros(numel, dtype=torch.float32, device=self.codec.device)
            for data in accepted:
                self.codec.decode_accumulate(data, acc)
            acc.div_(len(accepted))
        mean_bytes = self.codec.encode(acc)
        mean = self.codec.decode(mean_bytes).reshape(-1)
        return [
            AverageResult(
                round=round_index, committed=True, mean=mean, members=members,
                bytes_sent=allreduce_bytes_per_peer(contribution_bytes=len(e or b""), result_bytes=len(mean_bytes),
                                                    num_peers=k),
                # this peer's shard of everyone else's contribution, plus the others' shards of the mean
                bytes_received=(total_in - len(e or b"")) // k + (k - 1) * len(mean_bytes) // k,
            )
            for e in encoded
        ]

    def member(self, index: int) -> InProcessMember:
        if not 0 <= index < self.num_workers:
            raise ValueError(f"member index {index} is not in [0, {self.num_workers})")
        return InProcessMember(self, index)

    def _reduce_pending(self) -> None:
        rounds = {r for r, _ in self._pending.values()}
        if len(rounds) != 1:
            raise ValueError(f"members disagree on the round: {sorted(rounds)}")
        (round_index,) = rounds
        self._results = self.average_all(round_index, [self._pending[k][1] for k in range(self.num_workers)])
        self._pending.clear()

    def _average_one(self, index: int, round_index: int, delta: torch.Tensor) -> AverageResult:
        with self._lock:
            self._pending[index] = (round_index, delta)
        try:
            self._barrier.wait(timeout=self.timeout_s)
        except threading.BrokenBarrierError:
            with self._lock:
                self._pending.pop(index, None)
            return AverageResult(round=round_index, committed=False, mean=None, members=self.peer_ids,
                                 reason="in-process group broken (a member timed out or the reduce failed)")
        return self._results[index]


class InProcessMember:
    """Worker `index`'s view of an `InProcessGroup`: blocks in `average` until all K have arrived."""

    def __init__(self, group: InProcessGroup, index: int) -> None:
        self.group = group
        self.index = index

    def average(self, round_index: int, delta: torch.Tensor) -> AverageResult:
        return self.group._average_one(self.index, round_index, delta)
