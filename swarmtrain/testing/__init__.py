"""Test helpers (wait_until, LocalSwarm, FaultPlan, fakes, DialCounter in endpoints.py, the decoder fuzz targets in
fuzz.py, RoleSwarm in roles.py: pipeline roles in one process); imported by tests only, never by the library.
cluster.py (the in-process cluster), faults.py (FaultPlan, CrashPlan), state_faults.py (faults of state transfer),
procs.py (real subprocesses for system tests), pipeline.py (an in-process pipeline swarm), dashboard.py (synthetic
dashboards, headless Chromium), wait.py (deadline-bound waits), layers.py (the package layers and their checker),
sim/ (the deterministic simulation tester of the round's consensus), rounds.py (rounds without training, on any
device: a swarm that mixes GPU and CPU rounds).
"""

from swarmtrain.testing.faults import CrashPlan, FaultPlan
from swarmtrain.testing.wait import wait_until

__all__ = ["CrashPlan", "FaultPlan", "wait_until"]
