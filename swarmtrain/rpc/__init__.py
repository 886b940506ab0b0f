"""the only importer of grpc: servers, clients, deadlines, retries, chunked streams.

node.py: RpcNode (event-loop thread, grpc.aio server on port 0, channels, run-key auth, byte
counters, retries) and the typed RpcError family. averaging_wire.py: the all-reduce service and
its client calls. state_wire.py: the state-transfer service and client. faults.py: the
fault-injection seam (FaultSite, Fault, FaultHook) consulted by averaging/ and sync/.
"""

from swarmtrain.rpc.node import (
    ByteCounters,
    Rejected,
    RpcError,
    RpcNode,
    RpcRejected,
    RpcTimeout,
    RpcUnavailable,
    resolve_run_key,
)

__all__ = [
    "ByteCounters",
    "Rejected",
    "RpcError",
    "RpcNode",
    "RpcRejected",
    "RpcTimeout",
    "RpcUnavailable",
    "resolve_run_key",
]
