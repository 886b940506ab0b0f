"""Clock skew against the swarm, estimated from live peers' heartbeat times and corrected, and its field in
peer records."""

from __future__ import annotations

import pytest

from swarmtrain.config import DiscoveryConfig
from swarmtrain.discovery import PeerRecord, RecordError, estimate_clock_offset_s
from swarmtrain.discovery.records import decode_record
from swarmtrain.driver.presence import Presence

pytestmark = pytest.mark.unit

H = 2.0


def _rec(peer_id: str, heartbeat_at: float, **kw: float) -> PeerRecord:
    return PeerRecord(run_id="r", peer_id=peer_id, endpoint="127.0.0.1:1", heartbeat_at=heartbeat_at, **kw)


@pytest.mark.parametrize("skew_s", [-7.0, -1.0, 0.0, 3.0, 12.5])
def test_the_estimate_is_within_half_a_heartbeat_of_the_true_skew(skew_s: float) -> None:
    now = 1_000_000.0
    # other peers' clocks read (now + skew) and their records are between 0 and one heartbeat old
    peers = [_rec(f"p{i}", now + skew_s - age) for i, age in enumerate((0.1, 0.7, 1.2, 1.9, 0.4))]
    offset = estimate_clock_offset_s([*peers, _rec("me", now)], own_id="me", now=now, heartbeat_s=H)
    assert offset is not None and abs(offset - skew_s) <= H / 2


def test_one_peer_with_a_wild_clock_does_not_move_the_median() -> None:
    now = 5_000.0
    peers = [_rec("a", now - 1.0), _rec("b", now - 0.9), _rec("liar", now + 3000.0)]
    offset = estimate_clock_offset_s(peers, own_id="me", now=now, heartbeat_s=H)
    assert offset is not None and abs(offset) <= H / 2


def test_no_other_peer_gives_no_estimate() -> None:
    assert estimate_clock_offset_s([_rec("me", 10.0)], own_id="me", now=10.0, heartbeat_s=H) is None


def test_peer_records_carry_a_signed_offset_and_older_records_read_as_zero() -> None:
    rec = _rec("a", 100.0, clock_offset_s=-4.25)
    assert decode_record(PeerRecord, rec.encode(), run_id="r", signer_id="a").clock_offset_s == -4.25
    body = rec.to_json()
    del body["clock_offset_s"]
    assert PeerRecord.from_json(body).clock_offset_s == 0.0
    for bad in (float("nan"), 1e9):
        with pytest.raises(RecordError, match="clock_offset_s"):
            _rec("a", 100.0, clock_offset_s=bad)
    with pytest.raises(RecordError, match="clock_offset_s"):
        PeerRecord.from_json({**rec.to_json(), "clock_offset_s": "soon"})


class _Reads:
    """A Presence on a fake clock, read once a heartbeat: `note(at, now=...)` advances this peer's clock by a
    heartbeat and notes the others' records as of swarm time `at` (each beat half a heartbeat old; those
    in `stopped` as of `stopped_at`), read at swarm clock `now`."""

    def __init__(self, names: str = "abc") -> None:
        self.t = [100.0]
        self.names = names
        self.p = Presence(DiscoveryConfig(heartbeat_s=H), run_id="r", clock=lambda: self.t[0])

    def note(self, at: float, *, now: float, stopped: str = "", stopped_at: float = 0.0) -> float:
        self.t[0] += H
        peers = [_rec(x, (stopped_at if x in stopped else at) - H / 2) for x in self.names]
        return self.p.note(peers, own_id="me", now=now)


def test_a_peer_adopts_its_first_estimate_whole_then_corrects_by_halves_past_a_dead_band() -> None:
    r = _Reads()
    swarm_at = 1000.0
    assert r.note(swarm_at - H, now=swarm_at - H - 6.0) == 0.0  # the first read only notes the heartbeats
    assert r.note(swarm_at, now=swarm_at - 6.0) == pytest.approx(6.0)  # this clock is 6 s behind
    assert r.p.clock_offset_s == pytest.approx(6.0)
    assert r.note(swarm_at + H, now=swarm_at + H + 0.5) == 0.0  # within half a heartbeat: left alone
    assert r.note(swarm_at + 2 * H, now=swarm_at + 2 * H + 3.0) == pytest.approx(-1.5)  # later: half the residual
    assert r.p.clock_offset_s == pytest.approx(4.5)
    assert r.p.note([_rec("me", swarm_at)], own_id="me", now=swarm_at + 9.0) == 0.0  # nobody else: no estimate


def test_a_peer_is_settled_only_while_its_last_estimate_was_within_the_dead_band() -> None:
    # the peer reads the others every heartbeat until settled (roles/worker.py), then only at round boundaries
    r = _Reads("ab")
    swarm_at = 1000.0
    assert not r.p.settled  # no estimate yet
    r.p.note([_rec("me", swarm_at)], own_id="me", now=swarm_at)
    assert not r.p.settled  # alone: still no estimate
    r.note(swarm_at - H, now=swarm_at - H - 6.0)
    r.note(swarm_at, now=swarm_at - 6.0)
    assert not r.p.settled  # it just moved its clock: the next read tells whether it agrees now
    r.note(swarm_at + H, now=swarm_at + H + 0.5)
    assert r.p.settled
    r.note(swarm_at + 2 * H, now=swarm_at + 2 * H + 3.0)
    assert not r.p.settled  # off again: reading every heartbeat resumes


def test_heartbeats_that_stopped_moving_do_not_move_the_clock() -> None:
    """Two of three others stop beating (frozen, or across a partition) while their records live on: their
    ages grow like a clock falling behind, but the clock follows only the one that still beats."""
    r = _Reads()
    swarm_at = 1000.0
    r.note(swarm_at, now=swarm_at)
    r.note(swarm_at + H, now=swarm_at + H)
    assert r.p.settled and r.p.clock_offset_s == 0.0
    for k in range(2, 8):  # up to 12 s on: the records of b and c are that much older than a's
        at = swarm_at + k * H
        assert r.note(at, now=at, stopped="bc", stopped_at=swarm_at + H) == 0.0
    assert r.p.settled and r.p.clock_offset_s == 0.0


def test_a_read_long_after_the_last_only_notes_the_heartbeats_and_asks_for_a_check() -> None:
    """Reads minutes apart (round boundaries) cannot tell a record that stopped from a skewed clock: the
    late read moves nothing but unsettles the clock, and the next heartbeat's read decides."""
    r = _Reads()
    swarm_at = 1000.0
    r.note(swarm_at, now=swarm_at)
    r.note(swarm_at + H, now=swarm_at + H)
    assert r.p.settled
    r.t[0] += 300.0
    assert r.note(swarm_at + 300.0, now=swarm_at + 300.0, stopped="bc", stopped_at=swarm_at + 297.0) == 0.0
    assert not r.p.settled and r.p.clock_offset_s == 0.0
    assert r.note(swarm_at + 300.0 + H, now=swarm_at + 300.0 + H, stopped="bc", stopped_at=swarm_at + 297.0) == 0.0
    assert r.p.settled and r.p.clock_offset_s == 0.0  # only a beat: the clock was right
    r.t[0] += 300.0
    assert r.note(swarm_at + 600.0, now=swarm_at + 596.0) == 0.0  # all three 4 s ahead: checked first
    assert not r.p.settled
    assert r.note(swarm_at + 600.0 + H, now=swarm_at + 596.0 + H) == pytest.approx(2.0)  # confirmed: half of it


def test_a_peer_that_sees_nobody_for_two_record_ttls_rebootstraps_at_most_once_per_two_ttls() -> None:
    t = [100.0]
    presence = Presence(DiscoveryConfig(record_ttl_s=5.0, heartbeat_s=1.0), run_id="r", clock=lambda: t[0])
    t[0] += 9.9
    assert not presence.rebootstrap_due()  # not yet two TTLs alone
    t[0] += 0.2
    assert presence.rebootstrap_due()
    assert not presence.rebootstrap_due()  # just tried
    t[0] += 10.0
    assert presence.rebootstrap_due()  # still alone two TTLs later: again
    presence.saw_others(1)
    t[0] += 9.0
    assert not presence.rebootstrap_due() and presence.unseen_s() == pytest.approx(9.0)  # saw one recently
    t[0] += 2.0
    assert presence.rebootstrap_due()
