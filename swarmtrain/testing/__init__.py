"""Test helpers (wait_until, LocalSwarm, FaultPlan, fakes, DialCounter in endpoints.py, the decoder fuzz targets in
fuzz.py, RoleSwarm in roles.py: pipeline roles in one process); imported by tests only, never by the library."""

from swarmtrain.testing.faults import CrashPlan, FaultPlan
from swarmtrain.testing.wait import wait_until

__all__ = ["CrashPlan", "FaultPlan", "wait_until"]
