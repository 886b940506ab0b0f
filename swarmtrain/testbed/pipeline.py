"""A SWARM pipeline swarm inside testbed hosts: coordinator, stage servers and trainers, one host each."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.process.children import Child
from swarmtrain.telemetry.events import Line, StepEvent
from swarmtrain.testbed.netns import MAX_HOSTS, Testbed
from swarmtrain.testbed.shaping import TestbedError
from swarmtrain.testbed.swarm import TestbedSwarm

__all__ = ["PipelineLayout", "PipelineSwarm"]

_LAYOUT = re.compile(r"^(\d+):(\d+(?:,\d+)*):(\d+)$")


@dataclass(frozen=True)
class PipelineLayout:
    """How many stage servers each stage starts with, and how many trainers.

    Hosts: the coordinator on host 0, the servers on hosts 1..S (stages interleaved: s0a, s1a, s0b, ...),
    the trainers on the hosts after them.
    """

    servers_per_stage: tuple[int, ...]
    trainers: int

    def __post_init__(self) -> None:
        if not self.servers_per_stage:
            raise TestbedError("pipeline layout: stages must be >= 1")
        if any(n < 1 for n in self.servers_per_stage):
            raise TestbedError(f"pipeline layout: every stage needs >= 1 server, got {list(self.servers_per_stage)}")
        if self.trainers < 1:
            raise TestbedError(f"pipeline layout: trainers must be >= 1, got {self.trainers}")
        if self.num_hosts > MAX_HOSTS:
            raise TestbedError(f"pipeline layout: {self.num_hosts} hosts (1 coordinator + servers + trainers) "
                               f"is more than a testbed has ({MAX_HOSTS})")

    @classmethod
    def parse(cls, text: str) -> PipelineLayout:
        """`STAGES:SERVERS_PER_STAGE:TRAINERS`, e.g. `2:3:2`; SERVERS may be one count per stage (`2:4,2:2`)."""
        m = _LAYOUT.match(text.strip())
        if not m:
            raise TestbedError(f"pipeline layout {text!r}: expected STAGES:SERVERS_PER_STAGE:TRAINERS "
                               "(e.g. 2:3:2, or 2:4,2:2 for 4 servers on stage 0 and 2 on stage 1)")
        stages, trainers = int(m.group(1)), int(m.group(3))
        counts = [int(x) for x in m.group(2).split(",")]
        if stages < 1:
            raise TestbedError(f"pipeline layout {text!r}: stages must be >= 1")
        if len(counts) == 1:
            counts *= stages
        elif len(counts) != stages:
            raise TestbedError(f"pipeline layout {text!r}: {len(counts)} server counts for {stages} stages "
                               "(give one count, or one per stage)")
        return cls(servers_per_stage=tuple(counts), trainers=trainers)

    @property
    def stages(self) -> int:
        return len(self.servers_per_stage)

    @property
    def num_hosts(self) -> int:
        return 1 + sum(self.servers_per_stage) + self.trainers

    def servers(self) -> list[tuple[str, int, int]]:
        """(name, host, stage) of every server, stages interleaved so consecutive names hit different stages."""
        names: list[tuple[str, int]] = []
        for x in range(max(self.servers_per_stage)):
            names += [(f"s{k}{chr(97 + x)}", k) for k, n in enumerate(self.servers_per_stage) if x < n]
        return [(name, 1 + i, stage) for i, (name, stage) in enumerate(names)]

    def trainer_hosts(self) -> list[tuple[str, int]]:
        first = 1 + sum(self.servers_per_stage)
        return [(f"t{i}", first + i) for i in range(self.trainers)]

    def describe(self) -> str:
        counts = self.servers_per_stage
        per = str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))
        return f"{self.stages}:{per}:{self.trainers}"


class PipelineSwarm:
    """`swarmtrain coordinator` and `swarmtrain peer --role server|trainer` processes on an up Testbed.

    Every server and trainer binds its gRPC server to the testbed's data port, so the activations and
    gradients between them, and the stages' outer rounds, are counted in the kernel's data-plane class.
    """

    __test__ = False

    def __init__(self, testbed: Testbed, layout: PipelineLayout, *, log_dir: Path,
                 run_overrides: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        if len(testbed.hosts) < layout.num_hosts:
            raise TestbedError(f"pipeline {layout.describe()} needs {layout.num_hosts} hosts (1 coordinator, "
                               f"{sum(layout.servers_per_stage)} servers, {layout.trainers} trainers); testbed "
                               f"{testbed.name!r} has {len(testbed.hosts)}")
        self.layout = layout
        self.swarm = TestbedSwarm(testbed, log_dir=log_dir, env=env,
                                  run_overrides=[f"pipeline.stages={layout.stages}", *run_overrides])
        self.servers = {name: (host, stage) for name, host, stage in layout.servers()}
        self.trainers = dict(layout.trainer_hosts())
        self.ready: dict[str, dict[str, object]] = {}

    def start(self, *, timeout_s: float = 180.0) -> dict[str, dict[str, object]]:
        """Coordinator, then every server (READY), then the trainers (READY); returns each READY payload."""
        self.swarm.start_coordinator(host=0, timeout_s=timeout_s)
        children = {name: self.start_server(name) for name in self.servers}
        for name, child in children.items():
            self.ready[name] = child.wait_ready(timeout_s=timeout_s)
        trainers = {name: self.swarm.start_peer(name, host=host, extra=["--role", "trainer"])
                    for name, host in self.trainers.items()}
        for name, child in trainers.items():
            self.ready[name] = child.wait_ready(timeout_s=timeout_s)
        return dict(self.ready)

    def start_server(self, name: str) -> Child:
        """Start (or start again) server `name` on its host and stage (not waiting for READY)."""
        if name not in self.servers:
            raise TestbedError(f"no server {name!r} in pipeline {self.layout.describe()} ({sorted(self.servers)})")
        host, stage = self.servers[name]
        return self.swarm.start_peer(name, host=host, extra=["--role", "server", "--stage", str(stage)])

    def kill_server(self, name: str) -> None:
        """A crash: SIGKILL server `name`'s whole process group and reap it."""
        if name not in self.servers:
            raise TestbedError(f"no server {name!r} in pipeline {self.layout.describe()} ({sorted(self.servers)})")
        self.swarm.peers[name].kill()

    def restart_server(self, name: str) -> Child:
        """SIGKILL server `name`, then start it again on the same host, ports and stage."""
        self.kill_server(name)
        return self.start_server(name)

    def child(self, name: str) -> Child:
        if name == "coordinator" and self.swarm.coordinator is not None:
            return self.swarm.coordinator
        return self.swarm.peers[name]

    def lines(self, name: str) -> list[tuple[float, Line]]:
        """Every line process `name` printed, across its restarts."""
        return self.swarm.lines_of(name)

    def steps(self, name: str) -> list[StepEvent]:
        """Trainer `name`'s step lines."""
        return [x for _, x in self.swarm.lines_of(name) if isinstance(x, StepEvent)]

    def close(self, *, timeout_s: float = 15.0) -> None:
        self.swarm.close(timeout_s=timeout_s)

    def __enter__(self) -> PipelineSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
