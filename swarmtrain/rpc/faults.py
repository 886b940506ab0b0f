"""Fault injection's vocabulary: the sites of the data plane, the faults a hook may answer with, and the payload
changes they make (swarmtrain/testing/ applies them from outside, wrapping the transports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["CORRUPT_BYTES", "Fault", "FaultAction", "FaultHook", "FaultSite", "corrupt", "truncate"]

FaultAction = Literal["drop", "delay", "corrupt", "truncate", "forge", "unreachable"]
CORRUPT_BYTES = 16


@dataclass(frozen=True)
class FaultSite:
    """Where the data plane is about to act: `peer` does `call` in `round`, towards `target`.

    Calls: "push" (a member sends its shard to reducer `target`), "contributors" and "mean" (a
    reducer is asked for its contributor set / a mean by `target`), "state" (a peer serves its
    state to `target`).
    """

    peer: str
    round: int
    call: str
    target: str = ""


@dataclass(frozen=True)
class Fault:
    """What to do at a site: drop the message, delay it, corrupt or truncate its payload, alter it and its
    checksum as a man in the middle would (`forge`), or fail it as a call to a peer that cannot be reached
    (`unreachable`). (A crash is the test harness's:
    `swarmtrain.testing.faults.CrashPlan` closes the crashing peer's node.)"""

    action: FaultAction
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in ("drop", "delay", "corrupt", "truncate", "forge", "unreachable"):
            raise ValueError(f"Fault.action: unknown action {self.action!r}")
        if self.delay_s < 0:
            raise ValueError("Fault.delay_s: must be >= 0")


class FaultHook(Protocol):
    """Consulted at every site; None means act normally. Must be cheap and thread-safe."""

    def __call__(self, site: FaultSite) -> Fault | None: ...


def corrupt(payload: bytes | bytearray | memoryview) -> bytes:
    """A copy of the payload with bytes in its middle overwritten (0xFF: a NaN in fp32, a bad checksum in any
    codec)."""
    data = bytes(payload)
    if not data:
        return data
    mid = len(data) // 2
    return data[:mid] + b"\xff" * min(CORRUPT_BYTES, len(data) - mid) + data[mid + CORRUPT_BYTES:]


def truncate(payload: bytes | bytearray | memoryview) -> bytes:
    """A copy of the payload missing its last quarter (the header still declares the full size)."""
    return bytes(payload[: len(payload) * 3 // 4])
