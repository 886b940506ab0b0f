"""The roles a peer process runs, each composed from the services below it: a DiLoCo worker, or a pipeline stage
server or trainer.

base.py          RoleBase: joining the run (directory, DHT, run record, merged config), tally and metrics, and
                 closing what a role opened in reverse
worker.py        Peer: the DiLoCo worker, built as one frozen PeerParts; start and stop order, checkpoints
part_role.py     PartRole: what both pipeline roles share (a part's data plane and outer rounds, the heartbeat)
stage_server.py  StageServerRole: a stage server's one decision loop (pipeline/decisions.py) and its holdings
trainer.py       TrainerRole: a pipeline trainer's steps through the stage servers
process.py       a role as a process: uvloop, signals, /metrics
"""

from swarmtrain.roles.base import RoleBase
from swarmtrain.roles.stage_server import StageServerRole
from swarmtrain.roles.trainer import TrainerRole
from swarmtrain.roles.worker import Peer, PeerParts

__all__ = ["Peer", "PeerParts", "RoleBase", "StageServerRole", "TrainerRole"]
