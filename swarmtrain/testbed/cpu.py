"""A host's CPU: a cgroup per testbed host that caps what its processes may compute (root).

On one machine every namespace shares every core, so a stage server of the twin computes as fast as the
whole machine lets it, not as fast as a host of its own would. A cap makes each host a machine of
`cores` CPUs: the kernel's CFS bandwidth control lets the host's processes run `cores` x the period per
period (`cores` = 0.25: 2.5 ms of every 10 ms), whatever the others do, as long as the caps add up to
no more than the machine has.

Groups are named from the testbed (`swarmtrain-NAME-hI`, directly under the cpu controller's root), so
`teardown` finds them without a state file. cgroup v2 (`cpu.max`) is used where the unified hierarchy
offers the cpu controller, else v1 (`cpu.cfs_quota_us` under /sys/fs/cgroup/cpu). A process joins its
host's group before it runs anything (`join_argv`: a shell writes its own pid, then execs the command,
`ip netns exec ...`; the group must be joined outside the namespace, since `ip netns exec` mounts a fresh
sysfs without the cgroup tree), so every thread and child it makes is capped from the start.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.testbed.shaping import TestbedError

__all__ = ["MIN_CORES", "PERIOD_US", "CgroupRoot", "CpuCap", "caps_of", "cgroup_root", "group_name"]

PERIOD_US = 10_000  # short: a capped host computes in 10 ms slices, not in bursts of 100 ms
MIN_CORES = 0.1  # the kernel's least quota is 1 ms a period
_V2_ROOT = Path("/sys/fs/cgroup")
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_RMDIR_DEADLINE_S = 10.0  # a SIGKILLed process leaves its group once the kernel has reaped it


@dataclass(frozen=True)
class CgroupRoot:
    path: Path
    version: int  # 1 or 2


def cgroup_root(v2: Path = _V2_ROOT, v1: Path = _V1_ROOT) -> CgroupRoot | None:
    """Where the cpu controller is mounted (v2 preferred), or None where neither offers it."""
    controllers = v2 / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return CgroupRoot(v2, 2)
    if (v1 / "cpu.cfs_quota_us").is_file():
        return CgroupRoot(v1, 1)
    return None


def group_name(testbed: str, host: int) -> str:
    return f"swarmtrain-{testbed}-h{host}"


@dataclass(frozen=True)
class CpuCap:
    """The CPU cap of host `host` of testbed `testbed`: its cgroup under `root`."""

    root: CgroupRoot
    testbed: str
    host: int

    @property
    def path(self) -> Path:
        return self.root.path / group_name(self.testbed, self.host)

    @staticmethod
    def check_cores(cores: float) -> float:
        ncpu = os.cpu_count() or 1
        if not MIN_CORES <= cores <= ncpu:
            raise TestbedError(f"cpus={cores:g}: a host's CPU cap must be between {MIN_CORES:g} and this "
                               f"machine's {ncpu} cores")
        return cores

    def create(self, cores: float) -> None:
        """Make the group and set its cap; an existing group of the same name is an error (a leftover)."""
        quota = round(self.check_cores(cores) * PERIOD_US)
        try:
            if self.root.version == 2:
                _enable_cpu_controller(self.root.path)
            self.path.mkdir()
            if self.root.version == 2:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except FileExistsError as e:
            raise TestbedError(f"cgroup {self.path} already exists: run `swarmtrain testbed down --name "
                               f"{self.testbed}` first") from e
        except OSError as e:
            raise TestbedError(f"could not cap host {self.host} at {cores:g} CPUs in {self.path}: {e}") from e

    def cores(self) -> float | None:
        """The cap as set in the system, or None when this host has no group."""
        if not self.path.is_dir():
            return None
        if self.root.version == 2:
            quota, period = (self.path / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((self.path / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((self.path / "cpu.cfs_period_us").read_text())

    def throttled(self) -> tuple[int, float]:
        """(periods in which the cap stopped the host, seconds it was held back), from cpu.stat."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        if self.root.version == 2:
            return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_usec", 0)) / 1e6
        return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_time", 0)) / 1e9

    def join_argv(self, argv: list[str]) -> list[str]:
        """`argv` run as a member of this group from its first instruction (same pid: the shell execs)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def remove(self) -> bool:
        """Delete the group once its processes are gone (waits up to a deadline); False if there was none."""
        if not self.path.is_dir():
            return False
        deadline = time.monotonic() + _RMDIR_DEADLINE_S
        while True:
            try:
                self.path.rmdir()
                return True
            except OSError as e:  # EBUSY while a killed member is still being reaped
                if time.monotonic() > deadline:
                    raise TestbedError(f"could not remove cgroup {self.path}: {e} (processes still in it: "
                                       f"{_members(self.path)})") from e
                time.sleep(0.05)


def _members(path: Path) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    return []


def _enable_cpu_controller(root: Path) -> None:
    """cgroup v2: a child of `root` has cpu.max only once `root` hands the cpu controller down."""
    control = root / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu")


def caps_of(testbed: str, root: CgroupRoot | None = None) -> list[CpuCap]:
    """The groups of testbed `testbed` that exist, found by name."""
    root = root or cgroup_root()
    if root is None:
        return []
    prefix = f"swarmtrain-{testbed}-h"
    hosts = sorted(int(p.name[len(prefix):]) for p in root.path.glob(f"{prefix}*")
                   if p.is_dir() and p.name[len(prefix):].isdigit())
    return [CpuCap(root, testbed, h) for h in hosts]
