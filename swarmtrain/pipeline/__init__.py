"""SWARM pipeline parallelism: stage servers, router, rebalancer."""
