"""PeerStats: what a peer's record tells an operator about its work so far (the dashboard's input).

Small on purpose (a dozen numbers, re-sent every heartbeat); the history lives on the coordinator.
Decoding checks types only: a malformed field refuses the whole record, but a well-typed absurd value
(a negative byte count, a loss of 1e30) is carried as is, so the dashboard can show the peer as
invalid rather than hide it (swarmtrain/dashboard/validate.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MAX_TEXT_CHARS", "PeerStats", "StatsError"]

MAX_TEXT_CHARS = 200


class StatsError(ValueError):
    """A stats field of the wrong type."""


@dataclass(frozen=True)
class PeerStats:
    """Cumulative since the peer started, except `loss`, `val_loss`, `val_bpb`, `tokens_per_s` and `spread`
    (its last round's)."""

    loss: float | None = None  # mean training loss of its last round's inner steps
    val_loss: float | None = None  # validation loss of θ_global after its last evaluated round
    val_bpb: float | None = None  # that loss in bits per byte of the validation text
    tokens: int = 0  # training tokens of its inner steps
    tokens_per_s: float = 0.0  # of its last round's compute time
    bytes_sent: int = 0  # data-plane bytes
    bytes_received: int = 0
    compute_s: float = 0.0  # inner-step seconds
    comm_s: float = 0.0  # averaging seconds
    rounds_committed: int = 0
    rounds_aborted: int = 0
    heals: int = 0
    abort_reason: str = ""  # why its last aborted round aborted (cut to MAX_TEXT_CHARS)
    version: str = ""  # swarmtrain's version
    spread: float | None = None  # gossip: ‖φ_partner − φ‖ / ‖φ‖ of its last round with a partner

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> PeerStats:
        if not isinstance(d, Mapping):
            raise StatsError(f"stats: expected an object, got {type(d).__name__}")
        out: dict[str, Any] = {}
        for name, default in asdict(cls()).items():
            v = d.get(name, default)
            if isinstance(default, str):
                if not isinstance(v, str) or len(v) > MAX_TEXT_CHARS:
                    raise StatsError(f"stats.{name}: expected a string of at most {MAX_TEXT_CHARS} chars")
            elif v is None and name in ("loss", "val_loss", "val_bpb", "spread"):
                pass
            elif not isinstance(v, (int, float)) or isinstance(v, bool):
                raise StatsError(f"stats.{name}: expected a number, got {v!r}")
            elif isinstance(default, int) and not isinstance(v, int):
                raise StatsError(f"stats.{name}: expected an integer, got {v!r}")
            out[name] = v if isinstance(default, (str, int)) or v is None else float(v)
        return cls(**out)
