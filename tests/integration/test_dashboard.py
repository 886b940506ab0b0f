"""The dashboard against a real in-process swarm (2 DiLoCo peers, real matchmaking and all-reduce over
loopback gRPC, in-memory DHT): /api/status lists both peers with the round and θ hash their round lines
say; the coordinator's and a peer's /metrics parse with prometheus_client's own parser and carry the
counters their JSON lines add up to; malformed queries get 400; a record with absurd values is listed as
invalid and charted nowhere; a restarted dashboard keeps its history; the dashboard never writes to the DHT."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarmtrain.config import load_config
from swarmtrain.dashboard import Collector, Dashboard, History
from swarmtrain.discovery import InMemoryDiscovery, PeerRecord
from swarmtrain.discovery.stats import PeerStats
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter, RoundEvent
from swarmtrain.telemetry.prometheus import PeerCollector, serve_metrics
from swarmtrain.testing.cluster import TINY_RUN, EventLog, LoopbackServices, publish_run, run_peer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROUNDS = 3
KEY = "dashboard key"
# 20 inner steps a round: a round lasts longer than a heartbeat, so the records show every round reached.
RUN = [*TINY_RUN, "diloco.inner_steps=20", "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
       "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
       "rpc.call_timeout_s=3.0", f"diloco.rounds={ROUNDS + 50}"]  # they train on while the test looks


class ReadOnlyDiscovery(InMemoryDiscovery):
    """The coordinator's DHT view for the dashboard: any write fails the test (the dashboard only reads)."""

    async def _put(self, key: str, value: bytes, *, expires_at: float, timeout_s: float) -> None:
        raise AssertionError(f"the dashboard wrote {key} to the DHT")

    async def _delete(self, key: str, *, timeout_s: float) -> None:
        raise AssertionError(f"the dashboard deleted {key} from the DHT")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _metrics(text: str, keep: tuple[str, ...] = ("le",)) -> dict[str, float]:
    """name{label=value,...} -> value, for every sample (names as exposed: counters with _total; only the
    labels in `keep` go into the key)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k in keep)
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _timeline_shows_rounds(rows: list[dict[str, Any]]) -> bool:
    """Two rounds after the first at least, one of them sampled from both peers, four samples in all."""
    later = [r for r in rows if r["round"] > 0]
    return len(later) >= 2 and any(r["members"] == 2 for r in later) and sum(r["members"] for r in rows) >= 4


def test_dashboard_api_and_metrics_match_the_peers_lines(tmp_path: Path) -> None:
    async def main() -> dict[str, Any]:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, RUN, run_key=KEY)
        local = load_config(overrides=[f"rpc.run_key={KEY!r}", "discovery.heartbeat_s=0.2",
                                       "discovery.record_ttl_s=3.0"])
        logs = {n: EventLog() for n in "ab"}
        peers = {n: Peer(local, writer=EventWriter(logs[n]), services=services) for n in "ab"}
        metrics_port = serve_metrics(peers["a"].tally, port=0, host="127.0.0.1")
        stop = asyncio.Event()
        runs = [asyncio.create_task(run_peer(p, stop)) for p in peers.values()]
        coordinator = ReadOnlyDiscovery(services.registry, run_id=cfg.train.run_id, record_ttl_s=3.0,
                                        peer_id="coordinator", run_key=KEY)
        db = tmp_path / "dash.sqlite"
        dash_cfg = cfg.dashboard
        collector = Collector(coordinator, History(db, retention_rounds=1000), dash_cfg, record_ttl_s=3.0,
                              io_timeout_s=3.0)
        # The test polls (every 0.1 s below), not the server: what the routes answer between two polls is one state.
        dashboard = Dashboard(collector, host="127.0.0.1", port=0, poll_s=3600.0)
        port = await dashboard.start()
        base = f"http://127.0.0.1:{port}"
        # Both peers commit ROUNDS rounds and the timeline shows two rounds at least, one with both peers in it;
        # the dashboard polls meanwhile (they train on). A poll can miss a round shorter than a heartbeat, so a
        # fast machine may need more than ROUNDS rounds for that.
        deadline = asyncio.get_running_loop().time() + 120.0
        while not (all(len([e for e in log.rounds() if e.committed]) >= ROUNDS for log in logs.values())
                   and _timeline_shows_rounds(collector.history.rounds(since=0, limit=100))):
            assert not any(r.done() and r.exception() for r in runs), [r.exception() for r in runs if r.done()]
            assert asyncio.get_running_loop().time() < deadline, (
                [len(log.rounds()) for log in logs.values()], collector.history.rounds(since=0, limit=100))
            await asyncio.sleep(0.1)
            await collector.poll()
        await collector.poll()
        out: dict[str, Any] = {"logs": logs, "base": base}
        # A peer's metrics and its lines at one instant: nothing else runs on this loop in between.
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PeerCollector(peers["a"].tally))
        out["peer_metrics_now"] = generate_latest(registry).decode()
        out["lines_now"] = [e for e in logs["a"].events() if isinstance(e, RoundEvent)]
        out["status"] = json.loads((await asyncio.to_thread(_get, base + "/api/status"))[1])
        out["rounds"] = json.loads((await asyncio.to_thread(_get, base + "/api/rounds?since=0&limit=100"))[1])
        out["swarm_metrics"] = (await asyncio.to_thread(_get, base + "/metrics"))[1].decode()
        out["peer_metrics"] = (await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port}/metrics"))[1].decode()
        out["bad"] = [await asyncio.to_thread(_get, base + q) for q in
                      ("/api/rounds?since=abc", "/api/rounds?limit=0", "/api/rounds?limit=10001",
                       "/api/rounds?since=-1")]
        out["page"] = await asyncio.to_thread(_get, base + "/")
        out["vendor"] = (await asyncio.to_thread(_get, base + "/static/vendor/uPlot.iife.min.js"))[0]
        out["escape"] = (await asyncio.to_thread(_get, base + "/static/../history.py"))[0]
        out["ids"] = {n: p.discovery.peer_id for n, p in peers.items() if p.discovery is not None}

        # An absurd record (well-typed: it passes the DHT's checks) is listed as invalid and charted nowhere.
        liar = InMemoryDiscovery(services.registry, run_id=cfg.train.run_id, record_ttl_s=3.0, run_key=KEY)
        await liar.announce(PeerRecord(run_id=cfg.train.run_id, peer_id=liar.peer_id, endpoint="127.0.0.1:9",
                                       round=ROUNDS, state_hash="ab" * 32, heartbeat_at=liar.now(),
                                       stats=PeerStats(loss=1e9, tokens=-5, tokens_per_s=1e12)), timeout_s=1.0)
        await collector.poll()
        out["with_liar"] = json.loads((await asyncio.to_thread(_get, base + "/api/status"))[1])
        out["rounds_with_liar"] = json.loads((await asyncio.to_thread(_get, base + "/api/rounds"))[1])
        out["liar"] = liar.peer_id
        stop.set()
        await asyncio.gather(*runs)
        await dashboard.close()
        # A restarted dashboard reads the same history.
        again = Collector(coordinator, History(db, retention_rounds=1000), dash_cfg, record_ttl_s=3.0,
                          io_timeout_s=3.0)
        out["after_restart"] = again.history.rounds(since=0, limit=100)
        again.history.close()
        return out

    out = asyncio.run(main())
    logs, ids = out["logs"], out["ids"]
    committed = {n: {e.round + 1: e.hash for e in logs[n].rounds() if e.committed} for n in "ab"}
    status = out["status"]
    listed = {p["peer_id"]: p for p in status["peers"]}
    assert set(listed) == set(ids.values())
    for n in "ab":  # each listed at a round it reached, with the hash its round line printed for it
        p = listed[ids[n]]
        assert p["round"] >= ROUNDS and p["state_hash"] == committed[n][p["round"]], (p, committed[n])
        # its stats may lag its round by the one round line printed after the commit
        assert p["stats"]["rounds_committed"] in (p["round"] - 1, p["round"]) and p["state"] in ("ok", "behind")
    top = max(p["round"] for p in listed.values())
    assert status["round"] == top and status["hash_agreement"] == 1.0 and status["alerts"] == []
    assert all(p["hash_agrees"] is True for p in listed.values() if p["round"] == top)
    # The timeline: a row per round the records showed (a poll can miss a round shorter than a beat), each
    # with one hash, the one the peers' round lines print for it.
    by_round = {r["round"]: r for r in out["rounds"] if r["round"] > 0}
    assert len(by_round) >= 2 and any(r["members"] == 2 for r in by_round.values()), by_round
    for r, row in by_round.items():
        assert row["hashes"] == [committed["a"][r]] and row["part"] == -2, row

    # A peer's /metrics: what its JSON lines add up to (read at one instant); the HTTP endpoint serves them.
    mine = out["lines_now"]
    assert _metrics(out["peer_metrics"])["swarmtrain_rounds_committed_total"] >= ROUNDS
    pm = _metrics(out["peer_metrics_now"])
    assert pm["swarmtrain_rounds_committed_total"] == sum(e.committed for e in mine) >= ROUNDS
    assert pm["swarmtrain_rounds_aborted_total"] == sum(not e.committed for e in mine)
    assert pm["swarmtrain_bytes_sent_total"] == sum(e.bytes_sent for e in mine) > 0
    assert pm["swarmtrain_bytes_received_total"] == sum(e.bytes_received for e in mine) > 0
    assert pm["swarmtrain_loss"] == pytest.approx([e.loss for e in mine if e.loss is not None][-1])
    assert pm["swarmtrain_allreduce_seconds_count"] == len(mine)
    assert pm["swarmtrain_allreduce_seconds_sum"] == pytest.approx(sum(e.comm_s for e in mine))
    tokens_per_step = load_config(overrides=RUN).data.batch_size * load_config(overrides=RUN).data.seq_len
    assert pm["swarmtrain_tokens_total"] == sum(e.steps for e in mine) * tokens_per_step
    # The coordinator's /metrics: the swarm.
    sm = _metrics(out["swarm_metrics"], keep=("le", "role"))
    assert sm["swarmtrain_live_peers{role=worker}"] == 2 and sm["swarmtrain_hash_agreement"] == 1.0
    # every sample the timeline holds (a round shorter than a poll can be missed): both first ones and 2 more at least
    assert sm["swarmtrain_swarm_round"] >= ROUNDS
    assert sm["swarmtrain_swarm_rounds_sampled_total"] == sum(r["members"] for r in out["rounds"]) >= 4

    # Bad input: 400 with a message naming the parameter; the page and its vendored script are served.
    assert [code for code, _ in out["bad"]] == [400, 400, 400, 400]
    assert "since" in json.loads(out["bad"][0][1])["error"] and "limit" in json.loads(out["bad"][1][1])["error"]
    assert out["page"][0] == 200 and b"app.js" in out["page"][1] and out["vendor"] == 200
    assert out["escape"] in (403, 404)

    liar = next(p for p in out["with_liar"]["peers"] if p["peer_id"] == out["liar"])
    assert liar["state"] == "invalid" and any("loss" in x for x in liar["problems"])
    assert any(a["kind"] == "invalid_record" and a["peer"] == out["liar"] for a in out["with_liar"]["alerts"])
    assert out["with_liar"]["hash_agreement"] == 1.0  # its hash counts for nothing
    assert all("ab" * 32 not in r["hashes"] and r["members"] <= 2 for r in out["rounds_with_liar"])
    assert out["after_restart"] == out["rounds_with_liar"][:len(out["after_restart"])] and out["after_restart"]
