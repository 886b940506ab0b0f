"""The deterministic simulation tester of the round's consensus (run.py): virtual time (loop.py), a simulated
network (network.py) and DHT (dht.py), and peers running the production round driver on a small part
(part.py, peer.py).
legacy.py keeps the decision's rules from before consensus, as a voter the simulator can run for comparison.
scale.py runs it at a swarm's size: N peers on links of stated delay, with churn, measured.
"""
