"""Run membership (swarmtrain/trust): derived keys, call proofs with replay protection, sealed records,
and a directory that ignores every record not sealed by its run key."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.config import RunConfig, to_dict
from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry, PeerRecord, RunRecord
from swarmtrain.trust import (
    CallAuth,
    CallRefused,
    CallSigner,
    InsecureRunError,
    RunSecret,
    SealError,
    check_exposure,
    open_sealed,
    resolve_run_key,
    seal,
)

pytestmark = pytest.mark.unit

KEYED = RunSecret.from_run_key("correct horse")
NOW = 1_800_000_000.0
METHOD = "/swarmtrain.wire.Averaging/Push"


def test_run_key_env_overrides_config() -> None:
    assert resolve_run_key("from-config", env={}) == "from-config"
    assert resolve_run_key("from-config", env={"SWARMTRAIN_RUN_KEY": "from-env"}) == "from-env"


def test_derived_keys_differ_by_use_and_by_run_key_and_never_equal_the_key() -> None:
    other = RunSecret.from_run_key("correct horse!")
    keys = {KEYED.records, KEYED.calls, KEYED.tickets, other.records, other.calls, other.tickets}
    assert len(keys) == 6 and b"correct horse" not in b"".join(keys)
    assert KEYED.fingerprint() == RunSecret.from_run_key("correct horse").fingerprint() != other.fingerprint()
    assert not KEYED.open and RunSecret.from_run_key("").open
    assert "correct" not in repr(KEYED) and KEYED.records.hex() not in repr(KEYED)


def test_an_open_run_on_a_reachable_address_is_refused_unless_insecure() -> None:
    open_run = RunSecret.from_run_key("")
    check_exposure(open_run, ["127.0.0.1", "::1", "localhost"], insecure=False)  # loopback: fine
    check_exposure(KEYED, ["0.0.0.0"], insecure=False)  # a key: fine
    check_exposure(open_run, ["0.0.0.0"], insecure=True)  # said out loud
    for host in ("0.0.0.0", "10.1.2.3", "::", "peer.example.org"):
        with pytest.raises(InsecureRunError, match=r"run key is empty.*--insecure"):
            check_exposure(open_run, ["127.0.0.1", host], insecure=False)


def _call(auth: CallAuth, header: str, *, method: str = METHOD, caller: str = "alice", callee: str = "10.0.0.2:7000",
          now: float = NOW) -> None:
    auth.check(method=method, caller=caller, callee=callee, header=header, now=now)


def test_a_call_proof_is_accepted_once_for_its_method_caller_callee_and_time() -> None:
    signer, auth = CallSigner(KEYED, peer_id="alice"), CallAuth(KEYED, window_s=60)
    header = signer.header(method=METHOD, callee="10.0.0.2:7000", now=NOW)
    assert "correct horse" not in header
    for kwargs, words in (({"method": "/swarmtrain.wire.Averaging/Fetch"}, "wrong run key"),
                          ({"caller": "mallory"}, "wrong run key"), ({"callee": "10.0.0.3:7000"}, "wrong run key")):
        with pytest.raises(CallRefused, match=words):
            _call(auth, header, **kwargs)  # type: ignore[arg-type]
    _call(auth, header, now=NOW + 59)  # skew inside the window
    with pytest.raises(CallRefused, match="replayed"):
        _call(auth, header, now=NOW + 1)
    late = signer.header(method=METHOD, callee="10.0.0.2:7000", now=NOW - 61)
    with pytest.raises(CallRefused, match="outside"):
        _call(auth, late)
    with pytest.raises(CallRefused, match="wrong run key"):
        _call(auth, CallSigner(RunSecret.from_run_key("guess"), peer_id="alice").header(
            method=METHOD, callee="10.0.0.2:7000", now=NOW))
    for junk in ("", "correct horse", "1.2.3.4", "1." + "9" * 17 + "." + "0" * 32 + "." + "0" * 64):
        with pytest.raises(CallRefused, match="malformed"):
            _call(auth, junk)


def test_the_replay_guard_forgets_only_what_its_window_refuses_and_is_bounded() -> None:
    signer, auth = CallSigner(KEYED, peer_id="alice"), CallAuth(KEYED, window_s=10, max_per_caller=3)
    headers = [signer.header(method=METHOD, callee="e:1", now=NOW + i * 0.001) for i in range(5)]
    for h in headers[:4]:
        _call(auth, h, callee="e:1")
    assert auth.remembered() == 3  # the oldest was forgotten: the caller's floor is its time
    with pytest.raises(CallRefused, match="before the oldest"):
        _call(auth, headers[0], callee="e:1")  # so its replay is refused all the same
    with pytest.raises(CallRefused, match="replayed"):
        _call(auth, headers[2], callee="e:1", now=NOW + 10)  # still inside the window: still remembered
    _call(auth, headers[4], callee="e:1")  # a fresh call is never refused for want of room
    with pytest.raises(CallRefused, match="outside"):
        _call(auth, headers[2], callee="e:1", now=NOW + 21)  # forgotten, and refused by its time
    _call(auth, signer.header(method=METHOD, callee="e:1", now=NOW + 21), callee="e:1", now=NOW + 21)
    assert auth.remembered() == 1  # everything older than the window is gone


def test_a_flood_of_made_up_callers_locks_out_no_honest_caller() -> None:
    """The old guard refused every call once 200,000 nonces were remembered: a key holder's flood locked the
    honest peers out for a whole window. Now memory stays bounded and a call stamped now always passes."""
    auth = CallAuth(KEYED, window_s=300, max_per_caller=4, max_callers=16)
    honest = CallSigner(KEYED, peer_id="alice")
    _call(auth, honest.header(method=METHOD, callee="e:1", now=NOW), callee="e:1")
    for i in range(400):  # 100 made-up ids, some stamping ahead of the callee's clock
        flood = CallSigner(KEYED, peer_id=f"sybil-{i % 100}")
        at = NOW + 1 + i * 0.001
        _call(auth, flood.header(method=METHOD, callee="e:1", now=at + (i % 3) * 100), caller=f"sybil-{i % 100}",
              callee="e:1", now=at)
        assert auth.remembered() <= 16 * 4
    for caller in ("alice", "bob"):  # one it forgot, one it never heard from
        signer = CallSigner(KEYED, peer_id=caller)
        _call(auth, signer.header(method=METHOD, callee="e:1", now=NOW + 2), caller=caller, callee="e:1",
              now=NOW + 2)
    stale = honest.header(method=METHOD, callee="e:1", now=NOW)
    with pytest.raises(CallRefused, match="before the oldest"):  # alice was forgotten: older calls are suspect
        _call(auth, stale, callee="e:1", now=NOW + 2)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_no_header_text_gets_through_without_the_key(header: str) -> None:
    with pytest.raises(CallRefused):
        _call(CallAuth(KEYED), header)


def test_a_seal_binds_the_run_key_the_dht_key_and_the_signer() -> None:
    body = b'{"kind":"peer"}'
    value = seal(KEYED.records, dht_key="swarmtrain/r/peers", signer_id="alice", body=body)
    assert open_sealed(KEYED.records, value, dht_key="swarmtrain/r/peers", signer_id="alice") == body
    for kwargs in ({"dht_key": "swarmtrain/r/round/3/0/group"}, {"signer_id": "bob"}):
        args = {"dht_key": "swarmtrain/r/peers", "signer_id": "alice", **kwargs}
        with pytest.raises(SealError, match="another run key"):
            open_sealed(KEYED.records, value, **args)
    with pytest.raises(SealError, match="another run key"):
        open_sealed(RunSecret.from_run_key("").records, value, dht_key="swarmtrain/r/peers", signer_id="alice")
    tampered = value[:-1] + b"]"
    with pytest.raises(SealError, match="another run key"):
        open_sealed(KEYED.records, tampered, dht_key="swarmtrain/r/peers", signer_id="alice")
    for junk in (body, b"", b"STS1", 42):
        with pytest.raises(SealError):
            open_sealed(KEYED.records, junk, dht_key="swarmtrain/r/peers", signer_id="alice")


def test_a_keyed_directory_reads_only_records_sealed_by_its_key_and_logs_each_stranger_once(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = RunConfig()
    run_id = cfg.train.run_id

    async def main() -> None:
        reg = InMemoryRegistry()
        members = [InMemoryDiscovery(reg, run_id=run_id, record_ttl_s=60, run_key="k", peer_id=p) for p in "ab"]
        stranger = InMemoryDiscovery(reg, run_id=run_id, record_ttl_s=60, run_key="other", peer_id="s")
        opened = InMemoryDiscovery(reg, run_id=run_id, record_ttl_s=60, peer_id="o")  # an open run's peer
        await members[0].publish_run(RunRecord(run_id=run_id, coordinator_id="a", config=to_dict(cfg)), timeout_s=1)
        await stranger.publish_run(RunRecord(run_id=run_id, coordinator_id="s", config=to_dict(cfg), round=26),
                                   timeout_s=1)
        for d in (*members, stranger, opened):
            await d.announce(PeerRecord(run_id=run_id, peer_id=d.peer_id, endpoint="127.0.0.1:1", round=3,
                                        heartbeat_at=d.now()), timeout_s=1)
        for _ in range(3):  # a stranger re-announces every heartbeat: one line each all the same
            assert [p.peer_id for p in await members[1].live_peers(timeout_s=1)] == ["a", "b"]
        run = await members[1].fetch_run(timeout_s=1)  # no RunConflictError: the stranger's record is not read
        assert run is not None and run.coordinator_id == "a"
        assert [p.peer_id for p in await stranger.live_peers(timeout_s=1)] == ["s"]
        assert [p.peer_id for p in await opened.live_peers(timeout_s=1)] == ["o"]

    with caplog.at_level(logging.WARNING, logger="swarmtrain.discovery.protocol"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "from s:" in r.getMessage()]
    assert len(lines) == 2 and all("another run key" in line for line in lines)  # b's 4 reads and o's 1: a line each
