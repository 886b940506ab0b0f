"""A WAN twin on one Linux machine: hosts as network namespaces on a shaped bridge (needs root).

Map: shaping.py (rates, the htb tree, netem options) · netns.py (Testbed: namespaces, bridge,
veths, processes inside hosts; teardown by name) · delay.py (link delay in user space where the kernel
has no netem: a forwarder between each host's veth and its TAP on the bridge)
· cpu.py (a host's CPU cap: a cgroup per host)
· counters.py (kernel byte counters per host) · rates.py (those counters sampled over time: peak link rates)
· swarm.py (a coordinator and peers started inside the hosts, their JSON lines collected)
· pipeline.py (a pipeline swarm in the hosts: PipelineLayout, PipelineSwarm; kill/restart a server).
"""

from swarmtrain.testbed.counters import HostCounters, read_counters, total_wire_bytes
from swarmtrain.testbed.netns import DEFAULT_DATA_PORT, Host, Testbed, find_testbeds, require_root, teardown
from swarmtrain.testbed.shaping import LinkSpec, TestbedError, parse_rate

__all__ = [
    "DEFAULT_DATA_PORT",
    "Host",
    "HostCounters",
    "LinkSpec",
    "Testbed",
    "TestbedError",
    "find_testbeds",
    "parse_rate",
    "read_counters",
    "require_root",
    "teardown",
    "total_wire_bytes",
]
