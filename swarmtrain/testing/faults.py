"""FaultPlan: a deterministic table of faults keyed by (peer, round, call[, target]) for the data-plane seams;
CrashPlan: peers that crash at such a site."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from swarmtrain.rpc.faults import Fault, FaultAction, FaultSite
from swarmtrain.rpc.node import RpcNode

__all__ = ["CrashPlan", "FaultPlan"]

CRASH_HANG_S = 3600.0  # the crashing call's "delay": it is cancelled when the node's loop stops


@dataclass
class FaultPlan:
    """Answers `FaultHook` calls from a fixed table; records every site that fired.

    `add(peer="b", round=1, call="push", action="corrupt")` corrupts b's pushes in round 1 to every
    reducer; `target="c"` narrows it to pushes towards c. `times` bounds how often a rule fires
    (0 = always), so "drop the first push" does not also drop its retry when that matters.
    """

    _rules: list[tuple[FaultSite, Fault, int]] = field(default_factory=list)
    _fired: dict[int, int] = field(default_factory=dict)
    hits: list[tuple[FaultSite, Fault]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *, peer: str, round: int, call: str, action: FaultAction, target: str = "", delay_s: float = 0.0,
            times: int = 0) -> FaultPlan:
        self._rules.append((FaultSite(peer, round, call, target), Fault(action, delay_s), times))
        return self

    def __call__(self, site: FaultSite) -> Fault | None:
        with self._lock:
            for i, (rule, fault, times) in enumerate(self._rules):
                if (rule.peer, rule.round, rule.call) != (site.peer, site.round, site.call):
                    continue
                if rule.target and rule.target != site.target:
                    continue
                if times and self._fired.get(i, 0) >= times:
                    continue
                self._fired[i] = self._fired.get(i, 0) + 1
                self.hits.append((site, fault))
                return fault
        return None


class CrashPlan:
    """A `FaultHook` that crashes peers: when a crash site fires, the peer's `RpcNode` closes (its server
    stops answering and its own all-reduce is cancelled, as when its process dies) and the call at that
    site never answers. Other sites go to `plan`. Give it the nodes (`nodes[peer_id]`) before the round.
    """

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self.plan = plan if plan is not None else FaultPlan()
        self.nodes: dict[str, RpcNode] = {}
        self.crashed: list[FaultSite] = []
        self._sites: list[FaultSite] = []
        self._lock = threading.Lock()

    def crash(self, *, peer: str, round: int, call: str) -> CrashPlan:
        """`peer` crashes the first time it reaches `call` in `round` (any target)."""
        self._sites.append(FaultSite(peer, round, call))
        return self

    def __call__(self, site: FaultSite) -> Fault | None:
        with self._lock:
            gone = site.peer in {s.peer for s in self.crashed}
            due = not gone and (site.peer, site.round, site.call) in {(s.peer, s.round, s.call) for s in self._sites}
            if due:
                self.crashed.append(site)
        if gone:
            return Fault("delay", CRASH_HANG_S)  # a dead peer does nothing more, for anyone (itself included)
        if not due:
            return self.plan(site)
        # Called on the crashing node's own loop: close it from another thread (close joins that loop).
        threading.Thread(target=self.nodes[site.peer].close, name=f"crash-{site.peer}", daemon=True).start()
        return Fault("delay", CRASH_HANG_S)
