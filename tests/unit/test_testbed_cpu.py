"""A testbed host's CPU cap without root: controller discovery, the files a cap writes, joining a group."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from swarmtrain.testbed import LinkSpec, Testbed, TestbedError
from swarmtrain.testbed.cpu import PERIOD_US, CgroupRoot, CpuCap, caps_of, cgroup_root, group_name


def test_controller_discovery_prefers_v2_and_says_none_when_absent(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "unified", tmp_path / "cpu"
    v2.mkdir()
    v1.mkdir()
    assert cgroup_root(v2, v1) is None
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_root(v2, v1) == CgroupRoot(v1, 1)
    (v2 / "cgroup.controllers").write_text("memory pids\n")  # v2 without the cpu controller
    assert cgroup_root(v2, v1) == CgroupRoot(v1, 1)
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    assert cgroup_root(v2, v1) == CgroupRoot(v2, 2)


@pytest.mark.parametrize("version", [1, 2])
def test_cap_writes_quota_per_period_reads_it_back_and_is_found_by_name(tmp_path: Path, version: int) -> None:
    root = CgroupRoot(tmp_path, version)
    if version == 2:
        (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    cap = CpuCap(root, "tb1", 3)
    assert cap.cores() is None and cap.path.name == group_name("tb1", 3) == "swarmtrain-tb1-h3"
    cap.create(0.25)
    if version == 2:
        assert (cap.path / "cpu.max").read_text() == f"{PERIOD_US // 4} {PERIOD_US}"
        assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"  # handed down to the child groups
    else:
        assert (cap.path / "cpu.cfs_quota_us").read_text() == str(PERIOD_US // 4)
        assert (cap.path / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
    assert cap.cores() == 0.25
    with pytest.raises(TestbedError, match=r"already exists.*testbed down --name tb1"):
        cap.create(0.5)
    CpuCap(root, "tb1", 0).path.mkdir()
    (tmp_path / "swarmtrain-tb10-h1").mkdir()  # another testbed whose name starts alike
    (tmp_path / "swarmtrain-tb1-hx").mkdir()  # not a host group
    assert [c.host for c in caps_of("tb1", root)] == [0, 3]


def test_cores_outside_what_the_kernel_and_machine_allow_are_refused() -> None:
    for bad in (0.0, 0.05, -1.0, (os.cpu_count() or 1) + 1):
        with pytest.raises(TestbedError, match=f"cpus={bad:g}: a host's CPU cap must be between 0.1 and"):
            Testbed("ci1", num_hosts=1, link=LinkSpec(rate_bit_s=1_000_000), cpus=bad)
    assert Testbed("ci1", num_hosts=2, link=LinkSpec(rate_bit_s=1_000_000), cpus=0.1).cpus == {0: 0.1, 1: 0.1}
    assert Testbed("ci1", num_hosts=3, link=LinkSpec(rate_bit_s=1_000_000), cpus={2: 0.5}).cpus == {2: 0.5}
    assert Testbed("ci1", num_hosts=3, link=LinkSpec(rate_bit_s=1_000_000)).cpus == {}
    with pytest.raises(TestbedError, match=r"cpus: hosts \[3\] are not in 0..2"):
        Testbed("ci1", num_hosts=3, link=LinkSpec(rate_bit_s=1_000_000), cpus={3: 0.5})
    with pytest.raises(TestbedError, match=r"cpus=0\.01"):
        Testbed("ci1", num_hosts=3, link=LinkSpec(rate_bit_s=1_000_000), cpus={1: 0.01})


def test_join_argv_puts_the_command_itself_in_the_group(tmp_path: Path) -> None:
    cap = CpuCap(CgroupRoot(tmp_path, 1), "tb1", 0)
    cap.path.mkdir()
    # The pid the shell writes is the pid of the command it becomes: the command and all it starts are capped.
    out = subprocess.run(cap.join_argv(["sh", "-c", "echo $$; echo \"$1\"", "sh", "a b"]), capture_output=True,
                         text=True, check=True, timeout=20).stdout.split("\n")
    assert (cap.path / "cgroup.procs").read_text().strip() == out[0]
    assert out[1] == "a b"  # arguments pass through unsplit


def test_remove_deletes_an_empty_group_and_reports_absence(tmp_path: Path) -> None:
    cap = CpuCap(CgroupRoot(tmp_path, 1), "tb1", 0)
    assert cap.remove() is False
    cap.path.mkdir()
    assert cap.remove() is True and not cap.path.exists()
