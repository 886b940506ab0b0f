"""A pipeline swarm of the daemon roles in one process: stage servers and trainers on an in-memory DHT and
real loopback gRPC, each printing its lines into an `EventLog`, with the in-process SIGKILL of a server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch

from swarmtrain.config import RunConfig
from swarmtrain.roles import StageServerRole, TrainerRole
from swarmtrain.roles.stage_server import Holding
from swarmtrain.rpc.faults import FaultHook, FaultSite
from swarmtrain.telemetry import EventWriter, StepEvent
from swarmtrain.testing.cluster import EventLog, LoopbackServices, publish_run

__all__ = ["RoleSwarm"]

E = TypeVar("E")
_POLL_S = 0.05


class RoleSwarm:
    """`servers` (name -> stage) and `trainers` of the run `run` (sealed with `run_key`), each started with the
    local config `local()` and training until `finish()`; `async with` closes whatever is left.

    `logs[name]` holds each role's lines; `fault_hook` is consulted before each computation of every stage a
    server holds, at site (its peer, round = the stage, "forward"/"backward", the caller): a "delay" holds the
    compute thread that long (counted as compute), as a slower machine would.
    """

    def __init__(self, run: Sequence[str], *, run_key: str, local: Callable[[], RunConfig],
                 servers: Mapping[str, int], trainers: Sequence[str] = ("t",), fault_hook: FaultHook | None = None,
                 ) -> None:
        self.run, self.run_key, self.local = list(run), run_key, local
        self.placement, self.trainer_names, self.fault_hook = dict(servers), list(trainers), fault_hook
        self.logs = {n: EventLog() for n in [*servers, *trainers]}
        self.servers: dict[str, StageServerRole] = {}
        self.trainers: dict[str, TrainerRole] = {}
        self.stop = asyncio.Event()
        self._runs: list[asyncio.Task[str]] = []

    async def __aenter__(self) -> RoleSwarm:
        services = LoopbackServices()
        await publish_run(services.registry, self.run, run_key=self.run_key)
        try:
            for name, stage in self.placement.items():
                role = StageServerRole(self.local(), stage=stage, writer=EventWriter(self.logs[name]),
                                       services=services)
                if self.fault_hook is not None:
                    _slow_stages(role, self.fault_hook)
                self.servers[name] = role
                await role.start()
            for name in self.trainer_names:
                trainer = TrainerRole(self.local(), writer=EventWriter(self.logs[name]), services=services)
                self.trainers[name] = trainer
                await trainer.start()
                self._runs.append(asyncio.create_task(trainer.run(self.stop)))
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._close()

    def events(self, kind: type[E], names: Sequence[str] | None = None) -> list[E]:
        """The `kind` lines of `names` (every role by default), role by role."""
        return [e for n in (self.logs if names is None else names) for e in self.logs[n].events()
                if isinstance(e, kind)]

    def steps(self) -> list[StepEvent]:
        """The trainers' step lines."""
        return self.events(StepEvent, self.trainer_names)

    async def until(self, predicate: Callable[[], Any], *, timeout_s: float, what: str) -> None:
        """Wait until `predicate()` holds; AssertionError naming `what` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f} s"
            await asyncio.sleep(_POLL_S)

    async def kill(self, name: str) -> None:
        """The closest in-process SIGKILL of server `name`: its node closes and its record is not withdrawn (it
        expires)."""
        role = self.servers.pop(name)
        assert role.heartbeat is not None
        await role.heartbeat.aclose(withdraw=False)
        role.heartbeat = None
        await role.aclose("killed")

    async def finish(self, *, timeout_s: float = 30.0) -> list[str]:
        """Stop the trainers and return why each run ended ("signal" when stopped)."""
        self.stop.set()
        return [await asyncio.wait_for(run, timeout=timeout_s) for run in self._runs]

    async def _close(self) -> None:
        self.stop.set()
        for trainer in self.trainers.values():
            await trainer.aclose("signal")
        for role in self.servers.values():
            await role.aclose("signal")


def _slow_stages(role: StageServerRole, hook: FaultHook) -> None:
    """Wrap every stage `role` will hold so that its computations go through `hook` (see RoleSwarm)."""
    hold = role._hold

    async def held(*args: Any, **kwargs: Any) -> Holding:
        holding = await hold(*args, **kwargs)
        handler, timed = holding.handler, holding.handler._timed

        def slowed(method: str, caller: str, work: Callable[[], torch.Tensor]) -> torch.Tensor:
            fault = hook(FaultSite(handler.peer_id, handler.server.stage, method.lower(), caller))
            if fault is None:
                return timed(method, caller, work)
            if fault.action != "delay":
                raise ValueError(f"a stage server's compute takes only delay faults, not {fault.action!r}")
            delay_s = fault.delay_s

            def delayed() -> torch.Tensor:
                time.sleep(delay_s)
                return work()

            return timed(method, caller, delayed)

        handler._timed = slowed  # type: ignore[method-assign]
        return holding

    role._hold = held  # type: ignore[method-assign]
