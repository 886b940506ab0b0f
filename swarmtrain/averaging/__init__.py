"""protocol.py: the Averager protocol; matchmaking and the fault-tolerant butterfly all-reduce."""
