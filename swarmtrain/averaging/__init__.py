"""Averaging a round among peers: matchmaking, the fault-tolerant butterfly all-reduce, and the round's
decision among its voters.

(The Averager protocol the worker averages through is diloco/averager.py; a round's group, round/group.py.)
matchmaking.py who averages a round together (sequential attempts, the state digest most entries announce)
transport.py   the all-reduce's calls (ReduceTransport) and their gRPC implementation
allreduce.py   the member side of the all-reduce: pushes, contributor sets, pulls, the material it ends with
reducer.py     the reducer side (sessions, validation, fp32 means; bounded caches and waits)
standin.py     standing in for a reducer that died mid-round: its shard from a copy, or reduced again
aggregate.py   how a reducer combines contributions (mean, trimmed mean)
material.py    a round's material (its mean's encoded shards, by digest) and the store that keeps it
fetching.py    fetching material a peer misses from its holders
voting.py      a peer's voter: prepares, accepts, learns, retirement, signed grants (Paxos' acceptor)
deciding.py    the proposer and the learner (Paxos' phases 1 and 2, carrying forward chosen values)
rounds.py      one round end to end: the all-reduce, then the decision, into an AverageResult
network.py     NetworkAverager: all of it over gRPC for one scope (and a blocking facade)
inprocess.py   the in-process averager of simulations; attacks.py: what simulated Byzantine workers send
"""
