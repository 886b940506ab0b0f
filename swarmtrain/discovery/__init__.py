"""The only importer of hivemind: typed signed records on the DHT, an in-memory twin for tests.

records.py    RunRecord, PeerRecord (with a stage server's StageLoad), DepartureRecord, MatchEntry, GroupRecord:
              frozen, validated on decode
fields.py     the JSON codec of a record's fields, declared once on each field (`wire(reader)`)
protocol.py   the Discovery protocol and RecordDirectory (typed records over owner-signed slots)
memory.py     InMemoryRegistry + InMemoryDiscovery (no sockets)
hivemind_dht.py  HivemindDiscovery: one hivemind.DHT per peer, RSA owner-signed subkeys (import it
              explicitly: importing hivemind is heavy, so this package does not)
clock.py      estimate_clock_offset_s: this clock against the swarm's, from heartbeat times
heartbeat.py  Heartbeat: keep this peer's record alive, withdraw on leave
scoped.py     ScopedDiscovery: one averaging scope's view (a pipeline stage's servers, its trainers)
coordinator.py  RunPublisher: the coordinator publishes the run record and keeps its round current
stats.py      PeerStats: what a peer's record tells an operator about its work so far
"""

from swarmtrain.discovery.clock import estimate_clock_offset_s
from swarmtrain.discovery.heartbeat import Heartbeat
from swarmtrain.discovery.memory import InMemoryDiscovery, InMemoryRegistry
from swarmtrain.discovery.protocol import DirectoryIo, Discovery, DiscoveryError, RecordDirectory, RunConflictError
from swarmtrain.discovery.records import (
    DepartureRecord,
    GroupRecord,
    MatchEntry,
    PeerRecord,
    RecordError,
    RunRecord,
    StageLoad,
)
from swarmtrain.discovery.scoped import ScopedDiscovery

__all__ = [
    "DepartureRecord",
    "DirectoryIo",
    "Discovery",
    "DiscoveryError",
    "GroupRecord",
    "Heartbeat",
    "InMemoryDiscovery",
    "InMemoryRegistry",
    "MatchEntry",
    "PeerRecord",
    "RecordDirectory",
    "RecordError",
    "RunConflictError",
    "RunRecord",
    "ScopedDiscovery",
    "StageLoad",
    "estimate_clock_offset_s",
]
