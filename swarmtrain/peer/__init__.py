"""The peer daemon: a DiLoCo worker of a running swarm, composed from discovery, rpc, averaging and diloco.

root.py      Peer: the composition root; start/stop order, the classic round loop, heal, checkpoints
overlap.py   the round loop under `diloco.overlap` (a mixin of Peer)
rounds.py    rounds in flight: a Δ not yet committed, steps not yet sent, LocalRoundError
healing.py   state transfer into a running peer (a mixin of Peer)
watching.py  reads of the live peers: clock correction, waits for the swarm, DHT rejoin (a mixin of Peer)
heap.py      the C heap between rounds and inner steps (malloc_trim, mmap threshold)
presence.py  when other peers were last seen, and this clock against theirs (one log line each)
services.py  what a Peer is composed from: PeerServices, DataPlane (protocols), PeerState, PeerError
network.py   NetworkServices/NetworkPlane: hivemind DHT + gRPC, the services of a real peer
data.py      which slot of the data a peer reads
config.py    the run's config merged with the settings a peer owns itself
process.py   `swarmtrain peer` as a process: uvloop, signals
"""

from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.root import Peer
from swarmtrain.peer.services import DataPlane, PeerError, PeerServices, PeerState

__all__ = ["DataPlane", "Peer", "PeerError", "PeerServices", "PeerState", "merge_run_config"]
