"""What the roles of a peer process are composed from (swarmtrain/roles): the DiLoCo worker's part, the data plane
of a real peer, joining a run, the data slot, the peer's own settings, its memory and its local island.

part.py      WorkerPart: the worker's model as the round driver's part (train, preview, land a commit, adopt)
overlap.py   the round loop under `diloco.overlap` (a RoundDriver's launch/settle around the part)
rounds.py    inner steps not yet sent, and how inner steps end on a stop
joining.py   the run record to join, and the scope's genesis (round 0's voters) from it
heap.py      the C heap between rounds and inner steps (malloc_trim, mmap threshold)
services.py  what a role is composed from: PeerServices (a protocol), PeerError
network.py   NetworkServices/NetworkPlane: hivemind DHT + gRPC, the services of a real peer
data.py      which slot of the data a peer reads
config.py    the run's config merged with the settings a peer owns itself
memory.py    `train.memory_budget_mb` against what a DiLoCo worker holds
island.py    `--nproc-per-node N` and torchrun: the local ranks of one peer, started and joined
building.py  the worker a DiLoCo role builds (model, data slice, validation text), the checkpoint it resumes from
"""

from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.services import PeerError, PeerServices

__all__ = ["PeerError", "PeerServices", "merge_run_config"]
