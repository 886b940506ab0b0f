"""Lost stages with the daemon roles on an in-memory DHT and real loopback gRPC, under one trainer.

A stage's servers are killed (their nodes closed, their records left to expire, as after SIGKILL); once the
stage has had no live record for `lost_stage_grace_s`, one server of another stage that keeps a server takes
it: with `lost_stage = "neighbours"` a middle stage is rebuilt from the average of its two neighbours
(CheckFree); with `lost_stage = "checkpoint"` the server holding the freshest copy restores it, a last stage
too. The trainer's micro-batches, which waited for the stage, go through again, and the loss recovers."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time

import pytest

from swarmtrain.config import load_config
from swarmtrain.telemetry import StageRebuildEvent, StageRoundEvent, StepEvent
from swarmtrain.testing.roles import RoleSwarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "lost stage key"
TTL_S, GRACE_S = 2.0, 1.0
RUN = ["model.preset=tiny", "model.n_layer=3", "data.max_corpus_bytes=300000", "data.seq_len=16",
       "inner.warmup_steps=2", "inner.lr=3e-3", "diloco.rounds=1000", "diloco.inner_steps=10", "pipeline.stages=3",
       "pipeline.microbatch_size=2", "pipeline.samples_per_step=8", "pipeline.call_timeout_s=3",
       f"pipeline.lost_stage_grace_s={GRACE_S}", "pipeline.stage_wait_s=20", "pipeline.rebalance_drain_s=2",
       "discovery.heartbeat_s=0.2", f"discovery.record_ttl_s={TTL_S}", "rpc.call_timeout_s=3",
       "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false"]
BEFORE_STEPS = 30  # trainer steps before the kill
AFTER_STEPS = 30  # trainer steps after the rebuild
WINDOW = 5  # steps whose mean loss is compared
LOSS_FACTOR = 1.15  # the mean loss AFTER_STEPS after the rebuild, against the mean just before the kill


def _local():
    return load_config(overrides=[f"rpc.run_key={KEY!r}", "discovery.heartbeat_s=0.2",
                                  f"discovery.record_ttl_s={TTL_S}"])


async def _lose_stage(run: list[str], placement: dict[str, int], killed: list[str]) -> tuple[RoleSwarm, float]:
    """Serve `placement` (name -> stage), train BEFORE_STEPS steps, kill `killed`, wait for the one rebuild and
    AFTER_STEPS + WINDOW steps after it; the closed swarm (its logs and surviving servers) and the time of the
    kill."""
    async with RoleSwarm(run, run_key=KEY, local=_local, servers=placement) as swarm:
        await swarm.until(lambda: len(swarm.steps()) >= BEFORE_STEPS, timeout_s=40, what=f"{BEFORE_STEPS} steps")
        killed_at = time.time()
        for name in killed:
            await swarm.kill(name)
        await swarm.until(lambda: swarm.events(StageRebuildEvent), timeout_s=TTL_S + GRACE_S + 20,
                          what="the rebuild of the lost stage")
        rebuilt_at = swarm.events(StageRebuildEvent)[0].at
        await swarm.until(lambda: sum(e.at > rebuilt_at for e in swarm.steps()) >= AFTER_STEPS + WINDOW,
                          timeout_s=40, what=f"{AFTER_STEPS + WINDOW} steps after the rebuild")
        assert await swarm.finish() == ["signal"]
    return swarm, killed_at


def _check_recovery(swarm: RoleSwarm, rebuild: StageRebuildEvent, killed_at: float) -> str:
    """No micro-batch lost, every step after the rebuild whole, the loss back under LOSS_FACTOR × its value
    before the kill AFTER_STEPS steps after; returns a summary."""
    took_s = rebuild.at - killed_at
    assert took_s < TTL_S + GRACE_S + 10, f"stage {rebuild.stage} taken {took_s:.1f} s after the kill"
    steps = swarm.steps()
    assert all(len(e.lost_reasons) == e.lost and all(e.lost_reasons) for e in steps)  # none lost silently
    assert sum(e.lost for e in steps) == 0, [e.lost_reasons for e in steps if e.lost]  # they waited instead
    after = [e for e in steps if e.at > rebuild.at]
    assert sum(e.samples for e in after) == 8 * len(after)
    before_loss = statistics.mean(e.loss for e in steps[BEFORE_STEPS - WINDOW:BEFORE_STEPS] if e.loss is not None)
    after_loss = statistics.mean(e.loss for e in after[AFTER_STEPS:AFTER_STEPS + WINDOW] if e.loss is not None)
    assert after_loss < LOSS_FACTOR * before_loss, f"loss {before_loss:.3f} before the kill, {after_loss:.3f} after"
    peak = max(e.loss for e in after[:WINDOW] if e.loss is not None)
    return (f"stage {rebuild.stage} rebuilt ({rebuild.method}) from stage {rebuild.from_stage} {took_s:.1f} s after "
            f"the kill; loss {before_loss:.3f} before, up to {peak:.3f} just after, {after_loss:.3f} {AFTER_STEPS} "
            "steps after")


def test_a_lost_middle_stage_is_rebuilt_from_its_neighbours_and_training_goes_on() -> None:
    t0 = time.monotonic()
    swarm, killed_at = asyncio.run(_lose_stage(RUN, {"a": 0, "b": 0, "c": 1, "d": 2, "e": 2}, ["c"]))
    rebuilds = [(n, e) for n in "abde" for e in swarm.events(StageRebuildEvent, [n])]
    assert len(rebuilds) == 1, rebuilds  # one server took the stage
    name, rebuild = rebuilds[0]
    assert rebuild.stage == 1 and rebuild.method == "neighbours" and rebuild.weights == (0.5, 0.5), rebuild
    assert rebuild.from_stage in (0, 2) and swarm.servers[name].stage == 1
    assert [s.split()[:2] for s in rebuild.sources] == [["stage", "0"], ["stage", "2"]], rebuild.sources
    assert rebuild.lost_s >= GRACE_S and rebuild.round >= 1 and rebuild.hash, rebuild
    # Both stages the taker could have left keep a server, and the trainer's calls found stage 1 again.
    assert sorted(r.stage for r in swarm.servers.values()) in ([0, 1, 2, 2], [0, 0, 1, 2])
    print(f"{_check_recovery(swarm, rebuild, killed_at)}; test {time.monotonic() - t0:.1f} s")


def test_a_lost_last_stage_is_restored_from_the_freshest_copy_and_training_goes_on() -> None:
    """Both servers of the last stage die: CheckFree's average cannot rebuild it (one neighbour), a copy can. The
    copy restored is one the stage's own servers committed (its round and hash are among their rounds)."""
    t0 = time.monotonic()
    run = [*RUN, "pipeline.lost_stage='checkpoint'", "pipeline.stage_copy_period_s=0.5"]
    placement = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2, "f": 2}
    swarm, killed_at = asyncio.run(_lose_stage(run, placement, ["e", "f"]))
    rebuilds = [(n, e) for n in "abcd" for e in swarm.events(StageRebuildEvent, [n])]
    assert len(rebuilds) == 1, rebuilds
    name, rebuild = rebuilds[0]
    assert name in "cd" and rebuild.stage == 2 and rebuild.from_stage == 1, rebuild  # the neighbour with the copy
    assert rebuild.method == "checkpoint" and rebuild.weights == (1.0,) and len(rebuild.sources) == 1, rebuild
    _, _, _, copy_round, copy_hash, *_ = rebuild.sources[0].split()
    committed = {(e.round, e.hash[:12]) for e in swarm.events(StageRoundEvent, ["e", "f"]) if e.committed}
    assert int(copy_round) >= 1 and any(h == copy_hash for _, h in committed), (rebuild.sources, committed)
    assert swarm.servers[name].stage == 2 and sorted(r.stage for r in swarm.servers.values()) == [0, 0, 1, 2]
    print(f"{_check_recovery(swarm, rebuild, killed_at)}; copy {rebuild.sources[0]}; "
          f"test {time.monotonic() - t0:.1f} s")


def test_a_lost_last_stage_is_not_rebuilt_and_its_microbatches_are_reported_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    """The last stage has one neighbour: the taker says why it does not rebuild it, and the trainer, after
    `stage_wait_s`, reports each micro-batch lost with the stage in its reason."""
    caplog.set_level(logging.WARNING, logger="swarmtrain.roles.stage_server")

    async def main() -> list[StepEvent]:
        run = [*RUN, "pipeline.stage_wait_s=1"]
        async with RoleSwarm(run, run_key=KEY, local=_local, servers={"a": 0, "b": 0, "c": 1, "d": 2}) as swarm:
            await swarm.until(lambda: len(swarm.steps()) >= 3, timeout_s=40, what="3 steps")
            await swarm.kill("d")
            await swarm.until(lambda: sum(e.lost for e in swarm.steps()) >= 8, timeout_s=TTL_S + GRACE_S + 20,
                              what="micro-batches reported lost")
            await swarm.until(lambda: "is the last stage" in caplog.text, timeout_s=10, what="the refusal's log line")
            assert await swarm.finish() == ["signal"]
        assert not swarm.events(StageRebuildEvent)
        assert sorted(r.stage for r in swarm.servers.values()) == [0, 0, 1]
        return swarm.steps()

    steps = asyncio.run(main())
    lost = [why for e in steps for why in e.lost_reasons]
    assert sum(e.lost for e in steps) == len(lost) >= 8
    assert all("stage 2" in why for why in lost), lost
    assert "stage 2 has had no live server" in caplog.text and "it stays unserved" in caplog.text
