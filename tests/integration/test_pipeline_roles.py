"""The pipeline's daemon roles on an in-memory DHT with real loopback gRPC: servers announce their stage
(or take the least served one), a trainer finds them through their records and trains its steps; a server
that leaves mid-run is routed around and the trainer loses nothing."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.diloco.flat import state_digest
from swarmtrain.discovery import PeerRecord, StageLoad
from swarmtrain.pipeline.placement import least_served_stage
from swarmtrain.roles import StageServerRole, TrainerRole
from swarmtrain.telemetry import (
    EventWriter,
    HealEvent,
    LeaveEvent,
    ReadyLine,
    StageRoundEvent,
    StageStepEvent,
    StepEvent,
)
from swarmtrain.testing.cluster import EventLog, LoopbackServices, publish_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KEY = "pipeline key"
RUN = ["model.preset=tiny", "model.n_layer=3", "data.max_corpus_bytes=300000", "data.seq_len=16",
       "inner.warmup_steps=2", "diloco.rounds=6", "diloco.inner_steps=3", "pipeline.stages=2",
       "pipeline.microbatch_size=2", "pipeline.samples_per_step=8", "pipeline.call_timeout_s=3",
       "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3", "rpc.call_timeout_s=3",
       # SWARM's plain averaging: at 3 steps a round, Nesterov momentum 0.9 overshoots (docs/pipeline.md)
       "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false"]


def _local():
    # discovery is each peer's own section: beats (and reads of the part's holders) every 0.2 s here
    return load_config(overrides=[f"rpc.run_key={KEY!r}", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3"])


def test_the_least_served_stage_counts_servers_per_block() -> None:
    def server(i: int, stage: int) -> PeerRecord:
        return PeerRecord(run_id="r", peer_id=f"p{i}", endpoint=f"127.0.0.1:{1000 + i}", role="stage_server",
                          server=StageLoad(stage=stage))

    assert least_served_stage([], n_layer=3, stages=2) == 0
    # stage 0 holds 2 blocks, stage 1 one: one server on stage 0 still leaves stage 1 less served per block
    assert least_served_stage([server(1, 0)], n_layer=3, stages=2) == 1
    assert least_served_stage([server(1, 0), server(2, 1)], n_layer=3, stages=2) == 0
    assert least_served_stage([server(1, 0), server(2, 0), server(3, 1)], n_layer=3, stages=2) == 0  # a tie


def test_servers_and_a_trainer_find_each_other_and_a_leaving_server_costs_no_microbatch() -> None:
    async def main() -> dict[str, EventLog]:
        services = LoopbackServices()
        await publish_run(services.registry, RUN, run_key=KEY)
        logs = {n: EventLog() for n in ("a", "b", "c", "d", "t")}  # e: a late server, added below
        servers = {}
        for name, stage in (("a", 0), ("b", 1), ("c", None), ("d", None)):
            role = StageServerRole(_local(), stage=stage, writer=EventWriter(logs[name]), services=services)
            await role.start()  # one after another: c and d each take the least served stage then
            servers[name] = role
        trainer = TrainerRole(_local(), writer=EventWriter(logs["t"]), services=services)
        await trainer.start()
        stop = asyncio.Event()
        run = asyncio.create_task(trainer.run(stop))
        deadline = time.monotonic() + 120
        while trainer.trainer is None or trainer.trainer.step_count < 6:
            if run.done():  # it failed: its error, else that it ended early
                raise AssertionError(f"the trainer stopped before its 6th step: {run.result()!r}")
            assert time.monotonic() < deadline, "the trainer did not reach its 6th step"
            await asyncio.sleep(0.05)
        await servers["d"].aclose("signal")  # d leaves (its record is withdrawn) while the trainer trains
        reason = await asyncio.wait_for(run, timeout=120)
        await trainer.aclose(reason)
        # A server joining stage 0 now starts from that stage's θ_global (and outer momentum) of a live server.
        holders = [servers[n] for n in "ac"]
        deadline = time.monotonic() + 60
        def settled() -> bool:  # the last round applied by both, and none in flight: the state they serve stays
            rounds = [r.rounds for r in holders]
            return all(x is not None and x.round >= 1 and x.idle for x in rounds) and \
                len({(x.round, x.hash) for x in rounds if x is not None}) == 1

        while not settled():
            assert time.monotonic() < deadline, "stage 0's servers did not settle on one committed round"
            await asyncio.sleep(0.05)
        for r in holders:
            assert r.heartbeat is not None
            await r.heartbeat.beat()  # their records say so now, not at their next beat
        logs["e"] = EventLog()
        late = StageServerRole(_local(), stage=0, writer=EventWriter(logs["e"]), services=services)
        await late.start()
        # A stage one round ahead still keeps round 0's material: the late server learns that round from its
        # certificate. Further ahead, that material is gone (only the last committed round's is kept) and it
        # downloads the stage's newest state from the holders.
        heals = [e for e in logs["e"].events() if isinstance(e, HealEvent)]
        stage_round = holders[0].rounds.round
        if stage_round == 1:
            assert [(h.source, h.to_round) for h in heals] == [("certificate", 1)]
        else:
            assert heals and all(h.source != "certificate" for h in heals), heals
        heal = heals[-1]
        sources = heal.source.split(",")  # each served a range of the state (or the material, from a holder)
        donor = servers["a"] if heal.source == "certificate" else \
            next(r for r in servers.values() if r.discovery is not None and r.discovery.peer_id in sources)
        assert donor.stage == 0 and late.rounds is not None and late.server is not None
        # The stage may still be finishing a round started by the last steps: the late server heals to a round
        # the stage committed, with the θ_global hash the stage committed it with, and holds exactly that θ.
        committed = {e.round + 1: e.hash for n in "acd" for e in logs[n].events()
                     if isinstance(e, StageRoundEvent) and e.committed}
        assert heal.to_round > 0 and committed[heal.to_round] == heal.hash
        with late.server.still():
            held = late.rounds.snapshot(momentum=True)  # the digest covers round, θ_global, momentum and voters
            assert committed[late.rounds.round] == late.rounds.hash == \
                state_digest(held.round, held.theta_global, held.outer_momentum, held.voters)
            assert torch.equal(torch.cat([p.reshape(-1) for p in late.server.part.parameters()]), late.rounds.theta)
        # The records carry the stats the dashboard reads: the stage's committed rounds, the late server's heal.
        assert donor.discovery is not None and late.discovery is not None
        records = {p.peer_id: p for p in await donor.discovery.live_peers(timeout_s=3)}
        donor_stats, late_stats = records[donor.discovery.peer_id].stats, records[late.discovery.peer_id].stats
        assert donor_stats is not None and donor_stats.rounds_committed >= 1
        assert late_stats is not None and late_stats.heals >= 1 and late_stats.version
        stop.set()
        for name in ("a", "b", "c"):
            await servers[name].aclose("signal")
        await late.aclose("signal")
        return logs

    logs = asyncio.run(main())
    ready = {n: next(e for e in log.events() if isinstance(e, ReadyLine)).info for n, log in logs.items() if n != "e"}
    # c: 0.5 servers per block on stage 0 against 1 on stage 1; d: 1 and 1, a tie, the earlier stage
    assert [ready[n]["stage"] for n in "abcd"] == [0, 1, 0, 0]
    assert ready["a"]["blocks"] == [0, 2] and ready["b"]["blocks"] == [2, 3]
    steps = [e for e in logs["t"].events() if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == list(range(1, 19))
    assert sum(e.lost for e in steps) == 0, [(e.step, e.lost_reasons) for e in steps if e.lost]
    assert sum(e.microbatches for e in steps) == 18 * 4 and all(len(e.stage_latency_s) == 2 for e in steps)
    # The trainer learns: its last three steps' mean loss is below its first three's. One step's loss is not
    # compared: a step whose 8 samples hold a run of spaces (Python source) takes a large gradient, and the
    # stage server that steps on it can predict worse on the next batch (lr 3e-3, 16-token samples).
    losses = [e.loss for e in steps]
    assert all(x is not None and math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < sum(losses[:3])  # type: ignore[arg-type]
    leave = [e for e in logs["t"].events() if isinstance(e, LeaveEvent)]
    assert leave and leave[0].reason == "done" and leave[0].round == 18
    server_steps = {n: [e for e in logs[n].events() if isinstance(e, StageStepEvent)] for n in "abc"}
    assert all(server_steps[n] for n in "abc")  # every server stepped on its share of the samples
    assert all(e.stage == ready[n]["stage"] for n in "abc" for e in server_steps[n])
    # Stage 0's servers (a, c and d until it left) averaged their blocks: one θ_global hash per committed
    # round. Stage 1 has one server and there is one trainer: alone in their parts, they never try.
    rounds = [e for n in "acd" for e in logs[n].events() if isinstance(e, StageRoundEvent)]
    committed = {}
    for e in rounds:
        assert e.stage == 0
        if e.committed:
            committed.setdefault(e.round, set()).add(e.hash)
    assert committed and all(len(hashes) == 1 for hashes in committed.values()), committed
    assert not [e for n in "bt" for e in logs[n].events() if isinstance(e, StageRoundEvent)]


def test_a_server_takes_only_a_stage_that_fits_its_memory_budget() -> None:
    """n_layer=3 in 2 stages: stage 0 holds 2 blocks, stage 1 one. A budget between the two stages' needs:
    without --stage the server takes stage 1 (though stage 0 is the less served), --stage 0 is refused, and
    a budget below both is refused naming the smallest need."""
    from swarmtrain.peer.services import PeerError
    from swarmtrain.pipeline.memory import MB, server_bytes

    cfg = load_config(overrides=RUN)
    small, big = sorted(server_bytes(cfg.model, cfg.pipeline, seq_len=cfg.data.seq_len))
    budget = round((small + big) / 2 / MB)
    assert small <= budget * MB < big

    def local(mb: int):
        return load_config(overrides=[f"rpc.run_key={KEY!r}", f"train.memory_budget_mb={mb}"])

    async def main() -> tuple[int | None, list[str]]:
        services = LoopbackServices()
        await publish_run(services.registry, RUN, run_key=KEY)
        fits = StageServerRole(local(budget), writer=EventWriter(EventLog()), services=services)
        await fits.start()
        errors = []
        for stage, mb in ((0, budget), (None, 1)):
            role = StageServerRole(local(mb), stage=stage, writer=EventWriter(EventLog()), services=services)
            try:
                await role.start()
            except PeerError as e:
                errors.append(str(e))
            finally:
                await role.aclose("refused")
        stage = fits.stage
        await fits.aclose("signal")
        return stage, errors

    stage, errors = asyncio.run(main())
    assert stage == 1
    assert len(errors) == 2 and f"stage 0 needs {big / MB:.0f} MB" in errors[0] and "stages that fit: [1]" in errors[0]
    assert f"the smallest needs {small / MB:.0f} MB" in errors[1]


def test_a_stage_server_restarted_from_its_checkpoint_directory_is_the_same_peer(tmp_path) -> None:
    """A server's identity key lives in its checkpoint directory, as a worker's does: started again there, it
    is the same peer (so the same voter of its stage's rounds, never a new one leaving the old one's vote
    missing), and a second live process on the directory is refused."""
    from swarmtrain.peer.services import PeerError
    from swarmtrain.sync.checkpoint import CheckpointError

    def local():
        return load_config(overrides=[f"rpc.run_key={KEY!r}", f"checkpoint.dir={str(tmp_path / 's')!r}"])

    async def main() -> tuple[str, str, str]:
        services = LoopbackServices()
        await publish_run(services.registry, RUN, run_key=KEY)
        first = StageServerRole(local(), stage=0, writer=EventWriter(EventLog()), services=services)
        await first.start()
        assert first.discovery is not None
        before = first.discovery.peer_id
        second = StageServerRole(local(), stage=0, writer=EventWriter(EventLog()), services=services)
        try:
            await second.start()
            refused = ""
        except (CheckpointError, PeerError) as e:
            refused = str(e)
        finally:
            await second.aclose("refused")
        await first.aclose("signal")
        again = StageServerRole(local(), stage=0, writer=EventWriter(EventLog()), services=services)
        await again.start()
        assert again.discovery is not None
        after = again.discovery.peer_id
        await again.aclose("signal")
        return before, after, refused

    before, after, refused = asyncio.run(main())
    assert before == after
    assert "checkpoint" in refused.lower() or "directory" in refused.lower(), refused
