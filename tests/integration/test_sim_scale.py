"""The simulator at a swarm's size (swarmtrain/testing/sim/scale.py): its latency model, churn and measures."""

from __future__ import annotations

import dataclasses

import pytest

from swarmtrain.testing.sim.scale import ScaleRun, run_scale

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_quiet_swarm_commits_every_attempt_and_rounds_cost_the_links_round_trips() -> None:
    """No churn: every peer's every attempt commits, and a round's time outside compute grows with the links'
    delay (the same swarm on 5-50 ms access links against 50-100 ms ones), one state per round throughout."""
    near = run_scale(ScaleRun(peers=5, rounds=4, churn=0.0, access_ms=(5.0, 50.0)))
    far = run_scale(dataclasses.replace(near.run, access_ms=(50.0, 100.0)))
    for r in (near, far):
        assert not r.safety, r.safety
        assert r.rounds >= 3 and r.crashes == 0, r.summary()
        assert r.attempts_committed == r.attempts and r.rounds_first_try == r.rounds, r.summary()
        assert r.outside_s and r.calls > 0 and r.dht_ops > 0
    near_s, far_s = sorted(near.outside_s)[len(near.outside_s) // 2], sorted(far.outside_s)[len(far.outside_s) // 2]
    assert far_s > near_s + 0.2, (near.outside_s, far.outside_s)


def test_churn_crashes_peers_and_the_swarm_commits_on_with_one_state_per_round() -> None:
    r = run_scale(ScaleRun(peers=6, rounds=6, churn=0.15, seed=3))
    assert r.crashes >= 2, r.summary()
    assert not r.safety, r.safety
    assert r.rounds >= 4, r.summary()
