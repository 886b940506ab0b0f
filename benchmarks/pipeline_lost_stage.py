"""Lost-stage benchmark: how far a lost stage sets the model back, and how many steps the run needs to get
back, by each recovery method.

    python benchmarks/pipeline_lost_stage.py --arms neighbours,checkpoint,checkpoint-last --seeds 1,2

Each arm is a pipeline of the daemon roles in one process (in-memory DHT, loopback gRPC): 3 stages of one
block (tiny model), 2 servers per stage and one trainer. After `--before` trainer steps both servers of one
stage are killed (nodes closed, records left to expire, as after SIGKILL); once the stage has had no live
record for `pipeline.lost_stage_grace_s` a server of another stage takes it:

  neighbours        the middle stage, rebuilt from the mean of stages 0 and 2 (CheckFree, equal weights)
  checkpoint        the middle stage, restored from the freshest copy a spare server holds
  checkpoint-last   the last stage (which the neighbours method cannot rebuild), restored from a copy

Every `--eval-every` trainer steps the model is assembled from the trainer's ends and, for each stage, the
weights of its first live server (held still while copied), and evaluated on fixed validation batches of
the stdlib corpus. Figures per arm and seed:

  val before      mean val loss of the last 2 evaluations before the kill
  val after       val loss evaluated as soon as the rebuild is seen (the set-back)
  steps back      trainer steps after the rebuild until val loss is within --within (2%) of val before
                  (none: not within `--after` steps)
  lost            micro-batches the trainer lost (each has a reason in its step line)

Results: benchmarks/results/pipeline-lost-stage.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarmtrain.config import RunConfig, load_config  # noqa: E402
from swarmtrain.data import eval_batches, load_corpus  # noqa: E402
from swarmtrain.pipeline.parts import assemble  # noqa: E402
from swarmtrain.roles import StageServerRole, TrainerRole  # noqa: E402
from swarmtrain.telemetry import StageRebuildEvent, StepEvent  # noqa: E402
from swarmtrain.testing.roles import RoleSwarm  # noqa: E402

KEY = "lost stage benchmark key"
TTL_S, GRACE_S = 2.0, 1.0
RUN = ["model.preset=tiny", "model.n_layer=3", "data.max_corpus_bytes=300000", "data.seq_len=16",
       "inner.warmup_steps=2", "inner.lr=3e-3", "diloco.rounds=1000", "diloco.inner_steps=10", "pipeline.stages=3",
       "pipeline.microbatch_size=2", "pipeline.samples_per_step=8", "pipeline.call_timeout_s=3",
       f"pipeline.lost_stage_grace_s={GRACE_S}", "pipeline.stage_wait_s=20", "pipeline.rebalance_drain_s=2",
       "pipeline.stage_copy_period_s=2", "discovery.heartbeat_s=0.2", f"discovery.record_ttl_s={TTL_S}",
       "rpc.call_timeout_s=3", "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false"]
ARMS = {  # name: (pipeline.lost_stage, the stage whose servers are killed)
    "neighbours": ("neighbours", 1),
    "checkpoint": ("checkpoint", 1),
    "checkpoint-last": ("checkpoint", 2),
}
PLACEMENT = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2, "f": 2}
Batch = tuple[torch.Tensor, torch.Tensor]


def _local() -> RunConfig:
    return load_config(overrides=[f"rpc.run_key={KEY!r}", "discovery.heartbeat_s=0.2",
                                  f"discovery.record_ttl_s={TTL_S}"])


def _val_loss(trainer: TrainerRole, servers: dict[str, StageServerRole], cfg: RunConfig, val: list[Batch]) -> float:
    """The val loss of the model assembled from the trainer's ends and each stage's first live server."""
    assert trainer.trainer is not None
    parts = []
    for stage in range(cfg.pipeline.stages):
        role = next(r for r in servers.values() if r.stage == stage and r.holding is not None)
        holding = role.holding
        assert holding is not None
        with holding.server.moving():
            parts.append(copy.deepcopy(holding.part))  # its server trains the original on
    model = assemble(trainer.trainer.ends, parts, vocab_size=cfg.model.vocab_size)
    model.eval()
    with torch.no_grad():
        losses = [model(x, y)[1] for x, y in val]
    return float(torch.stack([loss for loss in losses if loss is not None]).mean())


async def _run_arm(arm: str, *, seed: int, before: int, after: int, eval_every: int, within: float,
                   val: list[Batch]) -> dict[str, Any]:
    method, lost_stage = ARMS[arm]
    run = [*RUN, f"train.seed={seed}", f"pipeline.lost_stage={method!r}"]
    cfg = load_config(overrides=run)
    evals: list[tuple[int, float]] = []  # (trainer steps, val loss)
    killed_step, rebuild, rebuilt_step, rebuilt_eval = 0, None, None, 0
    t0 = time.monotonic()
    async with RoleSwarm(run, run_key=KEY, local=_local, servers=PLACEMENT) as swarm:
        trainer = swarm.trainers["t"]

        async def evaluate() -> float:
            return await asyncio.to_thread(_val_loss, trainer, swarm.servers, cfg, val)

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = len(swarm.steps())
            if done >= (evals[-1][0] + eval_every if evals else eval_every):
                evals.append((done, await evaluate()))
            if not killed_step and done >= before:
                killed_step = done
                for name in [n for n, s in PLACEMENT.items() if s == lost_stage]:
                    await swarm.kill(name)
            if rebuild is None and swarm.events(StageRebuildEvent):
                rebuild, rebuilt_step, rebuilt_eval = swarm.events(StageRebuildEvent)[0], done, len(evals)
                evals.append((done, await evaluate()))  # the set-back, before later steps make up for it
            if rebuilt_step is not None and done >= rebuilt_step + after:
                break
            await asyncio.sleep(0.02)
        await swarm.finish()
    return _summary(arm, seed, evals, killed_step, rebuilt_step, rebuilt_eval, rebuild, swarm.steps(), within=within,
                    wall_s=time.monotonic() - t0)


def _summary(arm: str, seed: int, evals: list[tuple[int, float]], killed_step: int, rebuilt_step: int | None,
             rebuilt_eval: int, rebuild: StageRebuildEvent | None, steps: list[StepEvent], *, within: float,
             wall_s: float) -> dict[str, Any]:
    before = [v for s, v in evals if s <= killed_step][-2:]
    val_before = statistics.mean(before)
    out: dict[str, Any] = {"arm": arm, "seed": seed, "killed_step": killed_step, "rebuilt_step": rebuilt_step,
                           "val_before": val_before, "evals": evals, "lost": sum(e.lost for e in steps),
                           "lost_reasons": sorted({r for e in steps for r in e.lost_reasons}), "wall_s": wall_s}
    if rebuild is None or rebuilt_step is None:
        out["rebuild"] = None
        return out
    later = evals[rebuilt_eval:]  # the first one taken as soon as the rebuild was seen
    back = next((s - rebuilt_step for s, v in later if v <= val_before * (1 + within)), None)
    out.update(rebuild={"method": rebuild.method, "stage": rebuild.stage, "from_stage": rebuild.from_stage,
                        "sources": list(rebuild.sources), "lost_s": rebuild.lost_s, "round": rebuild.round},
               val_after=later[0][1] if later else None, steps_back=back,
               val_end=later[-1][1] if later else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="neighbours,checkpoint,checkpoint-last")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--before", type=int, default=80, help="trainer steps before the kill")
    ap.add_argument("--after", type=int, default=120, help="trainer steps after the rebuild")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--within", type=float, default=0.02)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline-lost-stage.json"))
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}: choose from {sorted(ARMS)}")
    cfg = load_config(overrides=RUN)
    corpus = load_corpus(cfg.data)
    val = eval_batches(corpus.val, batch_size=cfg.pipeline.microbatch_size, seq_len=cfg.data.seq_len,
                       num_batches=args.val_batches)
    torch.set_num_threads(1)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in arms:
            r = asyncio.run(_run_arm(arm, seed=seed, before=args.before, after=args.after,
                                     eval_every=args.eval_every, within=args.within, val=val))
            results.append(r)
            back = r.get("steps_back")
            print(f"{arm:<16} seed {seed}: val {r['val_before']:.4f} before, {r.get('val_after') or float('nan'):.4f} "
                  f"after the rebuild, back within {100 * args.within:.0f}% in "
                  f"{'-' if back is None else back} steps; lost {r['lost']}; {r['wall_s']:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "run": RUN, "placement": PLACEMENT, "within": args.within,
        "machine": "2-core x86 CPU", "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
