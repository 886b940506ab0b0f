"""Test helpers (wait_until, LocalSwarm, FaultPlan, fakes); imported by tests only, never by the library."""

from swarmtrain.testing.faults import FaultPlan
from swarmtrain.testing.wait import wait_until

__all__ = ["FaultPlan", "wait_until"]
