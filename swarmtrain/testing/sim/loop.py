"""A deterministic asyncio event loop on virtual time: sleeps and timeouts take no real time, and work handed to
threads (`asyncio.to_thread`) runs inline, so one seed gives one interleaving of every peer's tasks.

Time only moves when every task waits: the loop then jumps to the earliest timer. Nothing here does I/O; a
loop with nothing scheduled and nothing ready is deadlocked (`SimDeadlock`).

A simulation allocates a task, futures and timers per simulated call by the hundred thousand, so the cyclic
garbage collector's full passes (over every object alive, which grows with the swarm) took a quarter to a third
of a run at 32-64 peers. `run_virtual` freezes what existed before the run (imports, torch) out of those passes
and collects the youngest generation less often; neither changes what the simulation does."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple

__all__ = ["SimDeadlock", "VirtualClock", "VirtualLoop", "run_virtual"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# Allocations (net of deallocations) between two collections of the youngest generation while a simulation
# runs; CPython's default is 700. A simulated call allocates a few dozen objects, most of them freed by reference
# counting at once; the cyclic garbage a run leaves (a few hundred objects per peer and round) waits longer.
GC_YOUNG_THRESHOLD = 100_000


class SimDeadlock(RuntimeError):
    """Every task waits on something that no timer will ever wake."""


class VirtualClock:
    """Seconds since the simulation's start; `wall()` the same on a fixed epoch (what peers' clocks read)."""

    EPOCH = 1_800_000_000.0

    def __init__(self) -> None:
        self.now = 0.0

    def wall(self) -> float:
        return self.EPOCH + self.now


class _VirtualSelector(selectors.BaseSelector):
    """Holds the loop's self-pipe registration; `select` advances the clock instead of waiting."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimDeadlock("nothing is ready and no timer is set")
        self.clock.now += max(0.0, timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """See the module docstring."""

    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock if clock is not None else VirtualClock()
        super().__init__(selector=_VirtualSelector(self.clock))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(self, executor: Executor | None, func: Callable[[*Ts], T],
                        *args: *Ts) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as e:  # delivered to the awaiting task, as a thread's exception would be
            future.set_exception(e)
        return future


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`main()` to completion on a fresh VirtualLoop; every task it left is cancelled and the loop closed."""
    with _fewer_collections():
        loop = VirtualLoop()
        try:
            return loop.run_until_complete(main())
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """The collector's settings for a run (see the module docstring), restored after it. What a caller froze
    itself stays its own: then nothing is frozen here."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(threshold[0], GC_YOUNG_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()
