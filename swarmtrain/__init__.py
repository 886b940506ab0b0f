"""swarmtrain: train one model on many far-apart peers with DiLoCo and SWARM.

Map: config.py (typed run config) · models/ (GPT) · data/ (corpora, sharding) · diloco/ (outer
loop, pure torch) · compress/ (codecs, kernels) · averaging/ (matchmaking, all-reduce) ·
discovery/ (hivemind DHT) · rpc/ (gRPC) · sync/ (state transfer, checkpoints) · pipeline/ ·
telemetry/ · daemon/ (CLI) · dashboard/ · testing/ (test helpers; never imported by the library).
testbed/ (network-namespace WAN twin: shaped links, kernel byte counters; needs root).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
