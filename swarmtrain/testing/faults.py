"""FaultPlan: a deterministic table of faults keyed by (peer, round, call[, target]) for the data-plane seams."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from swarmtrain.rpc.faults import Fault, FaultAction, FaultSite

__all__ = ["FaultPlan"]


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
