"""A coordinator and peers started inside testbed hosts, their READY and round lines collected."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from swarmtrain.process.children import Child
from swarmtrain.telemetry.events import Line, RoundEvent
from swarmtrain.testbed.netns import Testbed
from swarmtrain.testbed.shaping import TestbedError, bulk_port_of
from swarmtrain.trust import RUN_KEY_ENV

__all__ = ["COORDINATOR_DHT_PORT", "PEER_DHT_PORT", "TestbedSwarm"]

log = logging.getLogger(__name__)

PEER_DHT_PORT = 7001
COORDINATOR_DHT_PORT = 7002  # distinct from a peer's, so a peer may share the coordinator's host


class TestbedSwarm:
    """`swarmtrain coordinator` and `swarmtrain peer` processes on the hosts of an up Testbed.

    Every peer binds its gRPC server to the testbed's data port, so the kernel's data-plane
    class counts exactly the traffic swarmtrain reports as bytes sent/received.
    """

    __test__ = False

    def __init__(self, testbed: Testbed, *, log_dir: Path, run_overrides: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.testbed = testbed
        self.log_dir = log_dir
        self.run_overrides = list(run_overrides)
        # Testbed addresses are not loopback: an open run would be refused there, so the run gets a key.
        run_key = os.environ.get(RUN_KEY_ENV) or secrets.token_hex(16)
        self.env = {"OMP_NUM_THREADS": "1", RUN_KEY_ENV: run_key, **(env or {})}
        self.coordinator: Child | None = None
        self.join_maddr = ""
        self.peers: dict[str, Child] = {}
        self._starts: dict[str, int] = {}
        self._children: list[Child] = []
        self._lock = threading.Lock()
        self.timeline: list[tuple[float, str, Line]] = []  # (monotonic arrival time, process name, line)
        self.released_at = 0.0  # monotonic time a harness let the peers start training (0 = at READY)

    def _on_line(self, name: str, line: Line) -> None:
        with self._lock:
            self.timeline.append((time.monotonic(), name, line))

    def lines_of(self, name: str) -> list[tuple[float, Line]]:
        """Every line process `name` printed (all its restarts), with the time it arrived here."""
        with self._lock:
            return [(t, line) for t, n, line in self.timeline if n == name]

    def _spawn(self, name: str, host: int, args: Sequence[str]) -> Child:
        n = self._starts.get(name, 0)
        self._starts[name] = n + 1
        log_path = self.log_dir / (f"{name}.log" if n == 0 else f"{name}.{n}.log")
        h = self.testbed.host(host)
        argv = self.testbed.exec_argv(host, [sys.executable, "-m", "swarmtrain", *args])
        env = {**self.env, "SWARMTRAIN_TESTBED_HOST": str(host), "SWARMTRAIN_TESTBED_IP": h.ip}
        child = Child(name, argv, log_path=log_path, env=env, on_line=self._on_line)
        self._children.append(child)
        return child

    def start_coordinator(self, *, host: int = 0, timeout_s: float = 60.0) -> str:
        """Start the coordinator on `host`; return the multiaddr peers join (its testbed address)."""
        ip = self.testbed.host(host).ip
        sets = [x for o in self.run_overrides for x in ("--set", o)]
        self.coordinator = self._spawn("coordinator", host,
                                       ["coordinator", "--host", ip, "--port", str(COORDINATOR_DHT_PORT), *sets])
        info = self.coordinator.wait_ready(timeout_s=timeout_s)
        maddrs = [str(m) for m in cast("list[object]", info.get("maddrs", []))]  # the READY line's JSON list
        on_bridge = [m for m in maddrs if f"/ip4/{ip}/" in m]
        if not on_bridge:
            raise TestbedError(f"the coordinator's READY line has no multiaddr on {ip}: {maddrs}")
        self.join_maddr = on_bridge[0]
        return self.join_maddr

    def start_peer(self, name: str, *, host: int, checkpoint_dir: Path | None = None,
                   extra: Sequence[str] = ()) -> Child:
        """Start (or restart) peer `name` on `host`, joined to the coordinator."""
        if not self.join_maddr:
            raise TestbedError("start the coordinator before the peers")
        ip = self.testbed.host(host).ip
        args = ["peer", "--join", self.join_maddr, "--host", ip, "--port", str(self.testbed.data_port),
                "--set", f"rpc.bulk_port={bulk_port_of(self.testbed.data_port)}", "--dht-port", str(PEER_DHT_PORT),
                *extra]
        if checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(checkpoint_dir)]
        child = self._spawn(name, host, args)
        self.peers[name] = child
        return child

    def rounds(self, name: str) -> list[RoundEvent]:
        """Every round line peer `name` printed (across restarts only the current process's)."""
        return [x for x in self.peers[name].snapshot() if isinstance(x, RoundEvent)]

    def close(self, *, timeout_s: float = 30.0) -> None:
        """SIGTERM every process (peers first), SIGKILL what outlives `timeout_s`.

        A leaving peer first serves the means its last group still needs (up to
        `averaging.contribution_window_s`, 15 s by default), then stops its DHT (up to 3 s): the
        default grace is docker-compose's `stop_grace_period` for the same reason."""
        for child in reversed(self._children):
            if child.alive:
                child.terminate(timeout_s=timeout_s)
            else:
                child.kill()  # reaps a leftover process group and closes the log
        self._children.clear()

    def __enter__(self) -> TestbedSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
