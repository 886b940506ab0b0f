"""Which peer records the dashboard shows as invalid: well-typed but absurd values are not trusted.

A record passes the DHT's checks (signed, sealed with the run key, well-typed) yet may still carry values
no honest peer reports: a negative or astronomically large count, a loss far outside what a byte-level
language model can score, a round far ahead of every other peer's. Such a peer is listed (so the operator
sees it) but marked invalid, and its numbers go into no chart, sum or alert.
"""

from __future__ import annotations

import math

from swarmtrain.discovery.records import PeerRecord

__all__ = ["MAX_BYTES", "MAX_LOSS", "MAX_ROUND_LEAD", "MAX_TOKENS_PER_S", "problems"]

MAX_LOSS = 100.0  # cross-entropy in nats; ln(vocab) is ~5.5 for bytes, ~11 for a 50k vocabulary
MAX_TOKENS_PER_S = 1e8  # far above any single peer
MAX_BYTES = 1 << 60
MAX_ROUND_LEAD = 1000  # rounds ahead of the median live peer


def problems(record: PeerRecord, *, median_round: int) -> list[str]:
    """What is absurd about `record` ([] = nothing): each problem names the field and its value."""
    out: list[str] = []
    if record.round > median_round + MAX_ROUND_LEAD:
        out.append(f"round {record.round} is more than {MAX_ROUND_LEAD} ahead of the swarm's {median_round}")
    s = record.stats
    if s is None:
        return out
    for name in ("loss", "val_loss"):
        v = getattr(s, name)
        if v is not None and not 0.0 <= v <= MAX_LOSS:
            out.append(f"{name} {v!r} is outside [0, {MAX_LOSS:g}]")
    for name in ("tokens", "bytes_sent", "bytes_received", "rounds_committed", "rounds_aborted", "heals"):
        v = getattr(s, name)
        if not 0 <= v <= MAX_BYTES:
            out.append(f"{name} {v!r} is not a count")
    if not 0.0 <= s.tokens_per_s <= MAX_TOKENS_PER_S:
        out.append(f"tokens_per_s {s.tokens_per_s!r} is outside [0, {MAX_TOKENS_PER_S:g}]")
    for name in ("compute_s", "comm_s"):
        v = getattr(s, name)
        if not (math.isfinite(v) and v >= 0.0):
            out.append(f"{name} {v!r} is negative")
    if s.rounds_committed > record.round + 1 and record.role == "worker":
        out.append(f"rounds_committed {s.rounds_committed} exceeds its round {record.round}")
    return out
