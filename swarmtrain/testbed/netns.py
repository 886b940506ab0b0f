"""The namespace twin: hosts as network namespaces on a bridge that lives in its own namespace.

Layout for testbed NAME with N hosts (every object is named from NAME, so `down` finds leftovers
from the system itself, not from a state file):

    NAME-sw   a namespace holding bridge br0 and the switch ends h0..h{N-1} of the host veths
    NAME-hI   host I: veth `eth0` with 10.77.0.(10+I)/24, `lo` up, IPv6 off

Nothing is created in the root namespace and nothing routes outside the bridge: the test
subnet exists only on br0. Each veth is shaped on the egress of both ends (see shaping.py).
A link delay is netem's where the kernel has it; elsewhere each switch end hI leaves the bridge to a
TAP `tI`, and the forwarder of delay.py, a process in NAME-sw, holds the frames between the two.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarmtrain.testbed.cpu import CpuCap, caps_of, cgroup_root
from swarmtrain.testbed.shaping import LinkSpec, TestbedError, shaping_commands

__all__ = ["DEFAULT_DATA_PORT", "Host", "Testbed", "find_testbeds", "host_argv", "require_root", "teardown"]

log = logging.getLogger(__name__)

DEFAULT_DATA_PORT = 7000
SUBNET_PREFIX = "10.77.0."
MAX_HOSTS = 200
DELAY_BY = ("auto", "netem", "forwarder")
FORWARDER_START_S = 20.0  # the delay forwarder opens every port within this (a Python start and N ioctls)
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_CMD_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address and the switch-side name of its link."""

    index: int
    netns: str
    ip: str
    switch_port: str  # the veth end in the switch namespace (its egress = this host's download)
    dev: str = "eth0"


def require_root() -> None:
    """Raise a TestbedError that says why when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise TestbedError("swarmtrain testbed needs root: network namespaces, veth pairs and tc need "
                           "CAP_NET_ADMIN (run it with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"swarmtrain testbed needs the `{tool}` command (package iproute2)")


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise TestbedError(f"testbed name {name!r}: must be 1-8 chars [a-z0-9], starting with a letter")


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def find_testbeds() -> dict[str, list[str]]:
    """Testbed name -> its namespaces, discovered from `ip netns list`."""
    found: dict[str, list[str]] = {}
    for ns in _netns_names():
        m = re.match(r"^([a-z][a-z0-9]{0,7})-(sw|h\d+)$", ns)
        if m:
            found.setdefault(m.group(1), []).append(ns)
    return {k: sorted(v) for k, v in found.items()}


def teardown(name: str) -> list[str]:
    """Kill every process in testbed `name`'s namespaces, delete them and its CPU caps' cgroups; idempotent.
    Returns what went (namespaces, then cgroups)."""
    _check_name(name)
    namespaces = find_testbeds().get(name, [])
    for ns in namespaces:
        # Only processes inside our own namespaces: we started them (or their children did).
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for ns in namespaces:
        # Deleting a namespace destroys its veth ends (and so the peers) and the bridge with it.
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in _netns_names():
            raise TestbedError(f"could not delete namespace {ns}: {proc.stderr.strip()}")
    for path in (forwarder_stats_path(name), forwarder_log_path(name)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    groups = [cap.path.name for cap in caps_of(name) if cap.remove()]
    if namespaces or groups:
        log.info("testbed %s removed: %s", name, ", ".join([*namespaces, *groups]))
    return [*namespaces, *groups]


class Testbed:
    """N hosts on a shaped private bridge; a context manager that always tears down what it built."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, name: str = "swt", *, num_hosts: int, link: LinkSpec,
                 data_port: int = DEFAULT_DATA_PORT, cpus: float | Mapping[int, float] | None = None,
                 delay_by: str = "auto") -> None:
        """`cpus`: cap every host at this many CPUs, or the hosts a mapping names at theirs (a cgroup each, see
        cpu.py); None leaves every host uncapped. `delay_by`: what holds the frames of a link with a delay:
        "netem" (the kernel's qdisc), "forwarder" (delay.py, in user space) or "auto" (netem where the kernel
        has it, else the forwarder)."""
        _check_name(name)
        if delay_by not in DELAY_BY:
            raise TestbedError(f"delay_by={delay_by!r}: must be one of {', '.join(DELAY_BY)}")
        self.delay_by = delay_by
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise TestbedError(f"num_hosts={num_hosts}: must be in [1, {MAX_HOSTS}]")
        self.name = name
        self.link = link
        caps = {i: cpus for i in range(num_hosts)} if isinstance(cpus, int | float) else dict(cpus or {})
        if any(not 0 <= i < num_hosts for i in caps):
            raise TestbedError(f"cpus: hosts {sorted(i for i in caps if not 0 <= i < num_hosts)} are not in "
                               f"0..{num_hosts - 1}")
        self.cpus = {i: CpuCap.check_cores(c) for i, c in sorted(caps.items())}  # host -> cores; absent: uncapped
        self.data_port = data_port
        self.switch_ns = f"{name}-sw"
        self.hosts = [Host(index=i, netns=f"{name}-h{i}", ip=f"{SUBNET_PREFIX}{10 + i}", switch_port=f"h{i}")
                      for i in range(num_hosts)]
        self._procs: list[subprocess.Popen[Any]] = []
        self._is_up = False
        self.forwarder_pid: int | None = None

    # ------------------------------------------------------------------ lifecycle

    def up(self, *, persist: bool = False) -> Testbed:
        """Create the namespaces, bridge and shaped links; on any failure remove everything.

        Unless `persist`, the testbed is also removed when this Python process exits.
        """
        require_root()
        existing = find_testbeds().get(self.name, []) + [cap.path.name for cap in caps_of(self.name)]
        if existing:
            raise TestbedError(f"testbed {self.name!r} already exists ({', '.join(existing)}); "
                               f"run `swarmtrain testbed down --name {self.name}` first")
        if self.cpus and cgroup_root() is None:
            raise TestbedError("cpus: this kernel offers no cpu cgroup controller (neither cgroup v2's cpu.max "
                               "nor v1's /sys/fs/cgroup/cpu), so hosts cannot be capped here; rerun without it")
        if not persist:
            atexit.register(self.down)
        self._is_up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        log.info("testbed %s up: %d hosts at %d bit/s", self.name, len(self.hosts), self.link.rate_bit_s)
        return self

    def _build(self) -> None:
        sw = self.switch_ns
        _run(["ip", "netns", "add", sw])
        # IPv6 off everywhere: link-local chatter (router solicitations, MLD) would pollute byte counts.
        _run(["ip", "netns", "exec", sw, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])
        _run(["ip", "netns", "exec", sw, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        forwarder = self._choose_delay(sw)
        # With the forwarder, the kernel shapes the rate only; the forwarder holds the frames.
        shaped = dataclasses.replace(self.link, delay_ms=0.0) if forwarder else self.link
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns])
            for key in ("all", "default"):
                _run(["ip", "netns", "exec", h.netns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", sw, "link", "add", h.switch_port, "mtu", str(self.link.mtu), "type", "veth",
                  "peer", "name", h.dev, "mtu", str(self.link.mtu), "netns", h.netns])
            if forwarder:  # a TAP stands on the bridge for the host; the forwarder joins the two
                tap = tap_of(h)
                _run(["ip", "-n", sw, "tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr"])
                _run(["ip", "-n", sw, "link", "set", tap, "mtu", str(self.link.mtu), "master", "br0", "up"])
            else:
                _run(["ip", "-n", sw, "link", "set", h.switch_port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", h.switch_port, "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.dev])
            _run(["ip", "-n", h.netns, "link", "set", h.dev, "up"])
            for ns, dev in ((h.netns, h.dev), (sw, h.switch_port)):
                for args in shaping_commands(dev, shaped, data_port=self.data_port):
                    _run(["tc", "-n", ns, *args])
            if h.index in self.cpus:
                root = cgroup_root()
                assert root is not None  # checked in up()
                CpuCap(root, self.name, h.index).create(self.cpus[h.index])
        if forwarder:
            self._start_forwarder()

    def _choose_delay(self, sw: str) -> bool:
        """Whether the user-space forwarder holds the frames (else netem, or nothing to hold)."""
        if not self.link.needs_netem:
            return False
        netem = self.delay_by != "forwarder" and has_netem(sw)
        if self.link.loss_pct > 0 and not netem:
            why = "delay_by='forwarder' was asked for" if self.delay_by == "forwarder" else \
                "this kernel has no netem qdisc (sch_netem)"
            raise TestbedError(f"--loss-pct needs netem and {why}: rerun without --loss-pct (rate and "
                               "--delay-ms work without netem), or on a kernel with netem")
        if self.delay_by == "netem" and not netem:
            raise TestbedError("delay_by='netem' but this kernel has no netem qdisc (sch_netem): use 'auto' or "
                               "'forwarder' (frames held in user space, testbed/delay.py)")
        log.info("testbed %s: link delay %g ms each end by %s", self.name, self.link.delay_ms,
                 "netem" if netem else "the user-space forwarder")
        return not netem

    def _start_forwarder(self) -> None:
        """The delay forwarder in the switch namespace (delay.py); returns once it holds every port."""
        argv = [sys.executable, "-m", "swarmtrain", "testbed", "forward", "--delay-ms", f"{self.link.delay_ms:g}",
                "--stats", forwarder_stats_path(self.name)]
        for h in self.hosts:
            argv += ["--port", f"{h.switch_port}:{tap_of(h)}"]
        # Its own session: it outlives `swarmtrain testbed up` (teardown kills it with the namespace's processes).
        with open(forwarder_log_path(self.name), "ab") as log_file:
            proc = subprocess.Popen(["ip", "netns", "exec", self.switch_ns, *argv], stdout=subprocess.PIPE,
                                    stderr=log_file, start_new_session=True)
        self._procs.append(proc)
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], FORWARDER_START_S)[0]
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line.strip() != b"READY":
            proc.kill()
            with open(forwarder_log_path(self.name), "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace").strip()
            raise TestbedError(f"the delay forwarder did not start within {FORWARDER_START_S:.0f}s"
                               f"{': ' + tail if tail else ''}")
        self.forwarder_pid = proc.pid

    def forwarder_stats(self) -> dict[str, Any] | None:
        """The delay forwarder's counters (frames, bytes, drops per port and direction, its CPU seconds), None
        when this testbed has none."""
        return read_forwarder_stats(self.name)

    def down(self) -> None:
        """Stop what this testbed started and delete its namespaces; safe to call twice."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not exit after SIGKILL", proc.pid)
        self._procs.clear()
        if self._is_up:
            teardown(self.name)
            self._is_up = False
        atexit.unregister(self.down)

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ use

    def host(self, index: int) -> Host:
        if not 0 <= index < len(self.hosts):
            raise TestbedError(f"host {index}: testbed {self.name!r} has hosts 0..{len(self.hosts) - 1}")
        return self.hosts[index]

    def exec_argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` inside host `index` (see `host_argv`)."""
        return host_argv(self.name, self.host(index).index, argv)

    def spawn(self, index: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside host `index` (`exec_argv`); `down()` kills it if it is still running."""
        h = self.host(index)
        full_env = {**os.environ, **(env or {}), "SWARMTRAIN_TESTBED_HOST": str(index),
                    "SWARMTRAIN_TESTBED_IP": h.ip}
        proc = subprocess.Popen(self.exec_argv(index, argv), env=full_env, **popen)
        self._procs.append(proc)
        return proc

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "switch": self.switch_ns, "data_port": self.data_port,
                "cpus": {str(i): c for i, c in self.cpus.items()},
                "link": {"rate_bit_s": self.link.rate_bit_s, "delay_ms": self.link.delay_ms,
                         "loss_pct": self.link.loss_pct, "mtu": self.link.mtu,
                         "delay_by": None if not self.link.needs_netem else
                         "forwarder" if self.forwarder_pid is not None else "netem"},
                "hosts": [{"index": h.index, "netns": h.netns, "ip": h.ip} for h in self.hosts]}


def host_argv(name: str, index: int, argv: Sequence[str]) -> list[str]:
    """The command line that runs `argv` inside host `index` of testbed `name`: its namespace, and its CPU cap
    if the system holds one (a testbed made by `up --cpus` in another process too)."""
    inside = ["ip", "netns", "exec", f"{name}-h{index}", *argv]
    root = cgroup_root()
    cap = None if root is None else CpuCap(root, name, index)
    # The cap is joined before `ip netns exec`, which mounts a sysfs without the cgroup tree.
    return cap.join_argv(inside) if cap is not None and cap.path.is_dir() else inside


def tap_of(host: Host) -> str:
    """The TAP that stands for `host` on the bridge when the forwarder delays its link."""
    return f"t{host.index}"


def forwarder_stats_path(name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"swarmtrain-testbed-{name}-delay.json")


def forwarder_log_path(name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"swarmtrain-testbed-{name}-delay.log")


def read_forwarder_stats(name: str) -> dict[str, Any] | None:
    """The counters testbed `name`'s delay forwarder last wrote (delay.py), None when it has none."""
    try:
        with open(forwarder_stats_path(name)) as f:
            stats: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return None
    return stats


def has_netem(netns: str) -> bool:
    """Whether this kernel offers netem (probed on `lo` of a namespace we own, then removed)."""
    proc = _run(["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
    if proc.returncode != 0:
        return False
    _run(["tc", "-n", netns, "qdisc", "del", "dev", "lo", "root"])
    return True


def tc_stats(netns: str, *args: str) -> str:
    """`tc -s ARGS` inside `netns` (iproute2 6.1 has no JSON output for classes)."""
    return _run(["tc", "-n", netns, "-s", *args]).stdout


def ip_json(netns: str, *args: str) -> list[dict[str, Any]]:
    """`ip -s -j ARGS` inside `netns`, parsed."""
    out = _run(["ip", "-n", netns, "-s", "-j", *args]).stdout
    return json.loads(out) if out.strip() else []
