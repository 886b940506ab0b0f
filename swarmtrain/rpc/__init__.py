"""the only importer of grpc: servers, clients, deadlines, retries, chunked streams.

node.py: RpcNode (event-loop thread, grpc.aio server on port 0, channels, per-call proof
of the run key (trust/calls.py), byte counters, retries). errors.py: the typed RpcError family and Rejected.
bulk.py: the bulk port (raw TCP, one-time tickets) that moves all-reduce payloads without gRPC's copies.
buffers.py: the BufferPool of payload-sized buffers reused across rounds. averaging_wire.py: the
all-reduce service (gRPC streams and bulk tickets); averaging_client.py: its client calls.
state_wire.py: the state-transfer service and client. frames.py: zero-copy chunk framing.
payload_macs.py: payload MACs computed off the event loop.
faults.py: the vocabulary of fault injection (FaultSite, Fault, FaultHook); swarmtrain/testing applies it
from outside, wrapping the transports (no fault branch lives in the shipped code).
consensus_wire.py: the round decision's service (Prepare, Accept, Learn, Certificates, Material) and client.
gossip_wire.py: the Gossip mailbox service and its client. pipeline_wire.py: the Pipeline service (Forward /
Backward). links.py: a bulk-port connection, plain or TLS. tls.py: this node's TLS from the run's authority.
"""

from swarmtrain.rpc.node import (
    ByteCounters,
    Rejected,
    RpcError,
    RpcNode,
    RpcRejected,
    RpcTimeout,
    RpcUnavailable,
)

__all__ = [
    "ByteCounters",
    "Rejected",
    "RpcError",
    "RpcNode",
    "RpcRejected",
    "RpcTimeout",
    "RpcUnavailable",
]
