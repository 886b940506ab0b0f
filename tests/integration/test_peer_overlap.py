"""Peers with diloco.overlap over the in-memory twins: rounds agree, a late joiner heals, aborts keep progress.

Uses the windowed all-reduce double and services of test_peer_composition.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_peer_composition import (
    RUN,
    Out,
    run_alone_then_stop,
    run_started_apart,
    run_with_late_joiner,
)

from swarmtrain.telemetry import HealEvent, LeaveEvent, RoundEvent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

OVERLAP = [*RUN, "diloco.overlap=true"]


def _committed_hashes(outs: dict[str, Out]) -> dict[int, set[str]]:
    by_round: dict[int, set[str]] = {}
    for out in outs.values():
        for e in out.rounds():
            if e.committed:
                by_round.setdefault(e.round, set()).add(e.hash)
    return by_round


def _story(outs: dict[str, Out]) -> dict[str, list[object]]:
    return {n: [(e.round, e.committed, e.members, e.hash[:8], e.reason) if isinstance(e, RoundEvent)
                else ("heal", e.from_round, e.to_round, e.hash[:8]) for e in out.events()
                if isinstance(e, (RoundEvent, HealEvent))] for n, out in outs.items()}


def test_overlapped_peers_agree_and_a_late_joiner_heals(tmp_path: Path) -> None:
    async def main() -> None:
        outs, peers = await run_with_late_joiner(tmp_path, OVERLAP)

        by_round = _committed_hashes(outs)
        assert sorted(by_round) == [0, 1, 2, 3, 4] and all(len(h) == 1 for h in by_round.values()), _story(outs)
        assert any(isinstance(e, HealEvent) for e in outs["c"].events())
        leaves = [e for out in outs.values() for e in out.events() if isinstance(e, LeaveEvent)]
        assert {e.reason for e in leaves} == {"done"} and len({e.hash for e in leaves}) == 1
        for n in "ab":  # every round's inner steps were taken once: H steps per round, none wasted
            assert peers[n].worker is not None and peers[n].worker.inner_step == 5 * 3, n
            assert not peers[n].worker.has_local_progress(), "the last round's average carried everything"

    asyncio.run(main())


def test_an_aborted_overlapped_round_is_sent_again_with_the_newer_progress(tmp_path: Path) -> None:
    """a averages round 0 alone (abort) while training round 1; its retry carries both rounds' steps."""

    async def main() -> None:
        outs, peers = await run_started_apart(tmp_path, [*OVERLAP, "diloco.rounds=3"])
        committed = {n: [(e.round, e.hash) for e in out.rounds() if e.committed] for n, out in outs.items()}
        assert committed["a"] == committed["b"] and [r for r, _ in committed["a"]] == [0, 1, 2], _story(outs)
        # a trained round 1 while its round 0 aborted; that work went into a later Δ, not thrown away.
        worker = peers["a"].worker
        assert worker is not None and worker.inner_step >= 3 * 3

    asyncio.run(main())


def test_stop_during_an_overlapped_round_finishes_its_average_first(tmp_path: Path) -> None:
    async def main() -> None:
        out, _, _ = await run_alone_then_stop(tmp_path, OVERLAP)
        rounds = [e.round for e in out.rounds()]
        assert rounds == list(range(len(rounds))) and all(e.committed for e in out.rounds())
        (leave,) = [e for e in out.events() if isinstance(e, LeaveEvent)]
        assert leave.round == rounds[-1] + 1 and Path(leave.checkpoint).is_file()

    asyncio.run(main())
