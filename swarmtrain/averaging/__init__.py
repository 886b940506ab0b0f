"""protocol.py: the Averager protocol; matchmaking and the fault-tolerant butterfly all-reduce.

allreduce.py: the member side of the all-reduce and its commit rule. reducer.py: the reducer side
(sessions, validation, fp32 means). network.py: NetworkAverager, the blocking Averager over gRPC.
"""
