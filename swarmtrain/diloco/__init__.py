"""DiLoCo, pure torch, no I/O or networking.

flat.py        params <-> one flat fp32 vector, Δ = θ_global − θ_local, hash of θ
outer.py       OuterOptimizer: SGD / Nesterov on θ_global with the averaged Δ
inner.py       inner AdamW/SGD, warmup + cosine schedule, checkpointable optimizer state
pace.py        diloco.pace: a round's inner-step budget, fixed H or a span shared by the round's group
worker.py      DilocoWorker: inner steps, Δ, outer step, eval, hash, state_dict (talks to an Averager)
averager.py    what the worker averages through: the Averager protocol, AverageResult, ShardedMean
steps.py       what the worker's calls take and return (InnerStats, InnerStep, Carry, RoundReport, DeltaError)
traffic.py     bytes per peer of one all-reduce (what simulations report)
simulation.py  K workers in one process: DiLoCo rounds or the data-parallel baseline
island.py      several local ranks (one process group) behind one peer: join, broadcast, failures
island_steps.py  rank 0's IslandWorker leads the inner steps, IslandFollowers mirror them; RankSlice data
eager.py       the eager estimate's scale: how much of a peer's own Δ to expect in the swarm's mean
fragments.py   streaming fragments: θ cut by transformer block, one part synced per round
spans.py       what a round syncs (all of θ, or one fragment): its Δ, eager estimate, outer step and digest
precision.py   how an inner step computes: autocast dtype, fp16's gradient scaler, micro-batches
worker_state.py  a worker's resumable state (what a checkpoint holds)
noloco.py      NoLoCo's outer step and the group means it takes
gossip_simulation.py  K NoLoCo workers in one process
island_shards.py  an island's model sharded with FSDP2 (`train.parallel = "fsdp"`)
"""

from swarmtrain.diloco.outer import OuterOptimizer
from swarmtrain.diloco.worker import DilocoWorker, InnerStats, RoundReport, resolve_device

__all__ = ["DilocoWorker", "InnerStats", "OuterOptimizer", "RoundReport", "resolve_device"]
