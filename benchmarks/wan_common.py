"""Shared by wan.py and churn.py: the workload, a DDP arm and a DiLoCo arm on a testbed, final evaluation.

Every arm trains the same GPT from the same seed on the same corpus; final weights are evaluated
here, by one function, on the same validation batches (a bigger set than the peers' per-round one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarmtrain.config import RunConfig, load_config
from swarmtrain.data import eval_batches, load_corpus
from swarmtrain.diloco.flat import assign_flat, flat_hash
from swarmtrain.models import build_model
from swarmtrain.process.children import Child
from swarmtrain.sync.checkpoint import load_latest_checkpoint
from swarmtrain.telemetry.events import LeaveEvent, Line, ReadyLine, RoundEvent
from swarmtrain.testbed import Testbed, read_counters
from swarmtrain.testbed.counters import HostCounters
from swarmtrain.testbed.swarm import TestbedSwarm

REPO = Path(__file__).resolve().parents[1]
DDP_PORT = 29500


@dataclass(frozen=True)
class Workload:
    """What every arm trains: model, data, and how many tokens (rounds x H steps x peers x batch)."""

    preset: str = "small"
    batch_size: int = 4
    seq_len: int = 128
    rounds: int = 8
    inner_steps: int = 50
    num_peers: int = 4
    corpus_bytes: int = 20_000_000
    eval_batches: int = 64  # final evaluation, the same batches for every arm
    seed: int = 0
    # Warm start (the DiLoCo paper's protocol): every arm continues from the same checkpoint of this
    # many DDP steps (K x B windows each, the DDP arm's own first steps); 0 = from the seeded init.
    warm_start_steps: int = 0
    init_from: str = ""  # the warm-start checkpoint (model.init_from), made by `make_warm_start`
    outer_lr: float = 0.0  # 0 = the config default
    # "sharded": peer k reads DDP rank k's slot of the one permutation (data.num_shards, --shard-index),
    # so every arm reads the same windows; "independent": each peer its own permutation (an open swarm).
    peer_data: str = "sharded"

    def run_overrides(self, *, codec: str = "fp32") -> list[str]:
        out = [
            f"model.preset={self.preset}", f"data.batch_size={self.batch_size}", f"data.seq_len={self.seq_len}",
            f"data.max_corpus_bytes={self.corpus_bytes}", f"diloco.rounds={self.rounds}",
            f"diloco.inner_steps={self.inner_steps}", "diloco.eval_batches=1", f"compress.codec={codec}",
            # like the DDP ranks, peers do not score every round: the harness evaluates the final weights
            "diloco.eval_every_rounds=0",
            f"train.seed={self.seed}", "train.threads=1",
        ]
        if self.init_from:  # peers go on from where the warm start left the stream, like the DDP ranks
            out += [f"model.init_from={self.init_from}", f"data.start_step={self.warm_start_steps}"]
        if self.peer_data == "sharded":
            out.append(f"data.num_shards={self.num_peers}")
        elif self.peer_data != "independent":
            raise ValueError(f"peer_data {self.peer_data!r} is not 'sharded' or 'independent'")
        if self.outer_lr:
            out.append(f"outer.lr={self.outer_lr!r}")
        if codec == "sparse":  # what a round does not send must stay in the residual
            out.append("compress.error_feedback=true")
        return out

    def config(self) -> RunConfig:
        return load_config(overrides=self.run_overrides())

    @property
    def tokens(self) -> int:
        return self.rounds * self.inner_steps * self.num_peers * self.batch_size * self.seq_len


def make_warm_start(workload: Workload, path: Path) -> Workload:
    """Train the warm-start checkpoint in this process (DDP math: one step on the K x B-window batch).

    Exactly the first `warm_start_steps` steps the DDP arm's ranks would take together (the same
    stream, its own warmup+cosine schedule); reused when `path` exists (it is deterministic).
    """
    from swarmtrain.diloco.simulation import simulate_ddp
    from swarmtrain.models import save_init_weights

    if not path.exists():
        if workload.warm_start_steps % workload.inner_steps:
            raise ValueError(f"warm_start_steps {workload.warm_start_steps} is not a multiple of "
                             f"H={workload.inner_steps}")
        cfg = workload.config().replace(diloco={"rounds": workload.warm_start_steps // workload.inner_steps})
        corpus = load_corpus(cfg.data)
        result = simulate_ddp(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=workload.num_peers)
        model = build_model(cfg.model, seed=cfg.train.seed)
        assign_flat(result.final_theta, list(model.parameters()))
        path.parent.mkdir(parents=True, exist_ok=True)
        save_init_weights(model, path)
        print(f"  warm start: {workload.warm_start_steps} DDP steps, val loss "
              f"{result.rounds[-1].val_loss:.4f} -> {path}", flush=True)
    return dataclasses.replace(workload, init_from=str(path.resolve()))


def evaluate(workload: Workload, load_weights: Callable[[torch.nn.Module], None]) -> float:
    """Mean validation loss of the weights `load_weights` puts into a fresh model."""
    cfg = workload.config().replace(diloco={"eval_batches": workload.eval_batches})
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_weights(model)
    model.eval()
    batches = eval_batches(load_corpus(cfg.data).val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                           num_batches=workload.eval_batches)
    with torch.no_grad():
        return statistics.fmean(float(model(x, y)[1]) for x, y in batches)


def _counters_summary(before: dict[int, HostCounters], after: dict[int, HostCounters]) -> dict[str, Any]:
    delta = {i: after[i].minus(before[i]) for i in after}
    return {
        "wire_bytes": sum(c.upload.total_bytes for c in delta.values()),
        "wire_data_bytes": sum(c.upload.data_bytes for c in delta.values()),
        "wire_data_payload_bytes": sum(c.upload.data_payload_bytes for c in delta.values()),
        "wire_dropped_packets": sum(c.upload.dropped + c.download.dropped for c in delta.values()),
        "per_host": {str(i): c.as_dict() for i, c in delta.items()},
    }


# ---------------------------------------------------------------------------------------------- DDP


def run_ddp(tb: Testbed, workload: Workload, *, out_dir: Path, timeout_s: float,
            extra_run: list[str] | None = None) -> dict[str, Any]:
    """K gloo ranks, one per host, `rounds x H` steps each; returns wall, utilization, bytes, val loss.

    `extra_run` is config for the ranks on top of the workload's (e.g. their own inner.lr); the warm
    start they continue from is the workload's either way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "ddp_final.pt"
    steps = workload.rounds * workload.inner_steps
    sets = [x for o in [*workload.run_overrides(), *(extra_run or [])] for x in ("--set", o)]
    env = {"GLOO_SOCKET_IFNAME": tb.host(0).dev, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    before = read_counters(tb.name)
    start = time.perf_counter()
    procs = []
    for rank in range(workload.num_peers):
        argv = [sys.executable, str(REPO / "benchmarks" / "ddp_worker.py"), "--rank", str(rank),
                "--world-size", str(workload.num_peers), "--master", f"{tb.host(0).ip}:{DDP_PORT}",
                "--steps", str(steps), "--start-step", str(workload.warm_start_steps), "--out", str(weights), *sets]
        log = (out_dir / f"ddp_rank{rank}.log").open("w")
        procs.append(tb.spawn(rank, argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True))
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
        if p.returncode != 0:
            raise RuntimeError(f"ddp rank exited {p.returncode}; see {out_dir}/ddp_rank*.log")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    counters = _counters_summary(before, read_counters(tb.name))
    val_loss = evaluate(workload, lambda m: m.load_state_dict(torch.load(weights, weights_only=True)))
    wall_s = max(r["wall_s"] for r in reports)
    return {
        "arm": "ddp", "wall_s": wall_s, "tokens": sum(r["tokens"] for r in reports),
        "compute_s": [r["compute_s"] for r in reports], "comm_s": [r["comm_s"] for r in reports],
        "utilization": [r["compute_s"] / r["wall_s"] for r in reports],
        "comm_fraction": [r["comm_s"] / r["wall_s"] for r in reports],
        # gloo does not count its bytes: a ring all-reduce sends 2(K-1)/K of the gradient per step and rank.
        "swarmtrain_bytes_sent": None,
        "expected_bytes_sent": int(2 * (workload.num_peers - 1) / workload.num_peers
                                   * sum(r["allreduced_bytes"] for r in reports)),
        "val_loss": val_loss, **counters,
    }


# ------------------------------------------------------------------------------------------- DiLoCo


@dataclass
class DilocoRun:
    """A live DiLoCo arm: the swarm and its peers' names -> hosts; `chaos` hooks act on it."""

    swarm: TestbedSwarm
    hosts: dict[str, int]
    checkpoint_dirs: dict[str, Path]
    peer_args: list[str] = field(default_factory=list)
    shards: dict[str, int] = field(default_factory=dict)  # a sharded run: each peer's slot, kept across restarts

    def restart(self, name: str) -> None:
        shard = ["--shard-index", str(self.shards[name])] if name in self.shards else []
        self.swarm.start_peer(name, host=self.hosts[name], checkpoint_dir=self.checkpoint_dirs[name],
                              extra=[*self.peer_args, *shard])


def start_diloco(tb: Testbed, workload: Workload, *, codec: str, out_dir: Path,
                 extra_run: list[str] | None = None, checkpoint_every: int = 1000,
                 env: dict[str, str] | None = None) -> DilocoRun:
    """Coordinator on host 0, peer i on host i; returns once every peer printed READY, all released together.

    Peers start training the moment they print READY, and on 2 busy cores their starts spread over
    seconds. Like DDP's barrier, a start barrier: each peer's main process is held (SIGSTOP; its DHT
    process keeps answering) from its READY line until every peer is READY, then all get SIGCONT.
    """
    run_cfg = [*workload.run_overrides(codec=codec), *(extra_run or [])]
    for stale in out_dir.glob("ckpt-*"):
        # A previous run of this arm left its peers' checkpoints here: they would resume from them.
        shutil.rmtree(stale)
    swarm = TestbedSwarm(tb, log_dir=out_dir / "logs", run_overrides=run_cfg, env=env)
    swarm.start_coordinator(host=0, timeout_s=120)
    names = {f"p{i}": i for i in range(workload.num_peers)}
    run = DilocoRun(swarm, names, {n: out_dir / f"ckpt-{n}" for n in names},
                    peer_args=["--set", f"checkpoint.every_rounds={checkpoint_every}"],
                    shards=dict(names) if workload.peer_data == "sharded" else {})
    for name in names:
        run.restart(name)
    held = []
    try:
        for name in names:
            child = swarm.peers[name]
            child.wait_ready(timeout_s=180)
            os.kill(child.proc.pid, signal.SIGSTOP)
            held.append(child.proc.pid)
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    swarm.released_at = time.monotonic()
    return run


def finish_diloco(run: DilocoRun, workload: Workload, *, timeout_s: float, before: dict[int, HostCounters],
                  straggler_grace_s: float = 60.0) -> dict[str, Any]:
    """Wait for every peer to finish its rounds; summarize rounds, time, bytes, agreement, final loss."""
    swarm = run.swarm
    try:
        stragglers = _wait_for_leaves(swarm, timeout_s=timeout_s, grace_s=straggler_grace_s)
    finally:
        dump_events(swarm)
    counters = _counters_summary(before, read_counters(swarm.testbed.name))
    summary = summarize_rounds(swarm, list(run.hosts))
    events = swarm.log_dir / "events.jsonl"
    summary.update(heal_accounting(events, workload), **send_spread(events), stopped_stragglers=stragglers,
                   tokens=sum(summary["steps_per_peer"]) * workload.batch_size * workload.seq_len)
    # The final weights of a peer that committed every round (a straggler may be a round short).
    done = [n for n in run.hosts if n not in stragglers]
    ckpt = load_latest_checkpoint(run.checkpoint_dirs[done[0]])
    if ckpt is None:
        raise RuntimeError(f"{done[0]} left no checkpoint in {run.checkpoint_dirs[done[0]]}")
    theta = ckpt.tensors["theta_global"]
    summary["final_hash"] = flat_hash(theta)
    summary["val_loss"] = evaluate(workload, lambda m: assign_flat(theta, list(m.parameters())))
    return {**summary, **counters}


def _left(child: Child) -> bool:
    return any(isinstance(x, LeaveEvent) for x in child.snapshot())


def _wait_for_leaves(swarm: TestbedSwarm, *, timeout_s: float, grace_s: float) -> list[str]:
    """Wait until every peer printed its leave line; returns the stragglers it had to stop.

    A peer that missed the last round cannot finish once the others have left (no group, no donor
    to heal from): `grace_s` after the first peer finished, the rest get SIGTERM (graceful leave at
    the end of their current round), then SIGKILL if they are still running a minute later.
    """
    deadline = time.monotonic() + timeout_s
    first_done: float | None = None
    while True:
        pending = {n: c for n, c in swarm.peers.items() if not _left(c)}
        if not pending:
            return []
        if first_done is None and len(pending) < len(swarm.peers):
            first_done = time.monotonic()
        if first_done is not None and time.monotonic() - first_done > grace_s:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers {sorted(pending)} did not finish within {timeout_s:.0f}s")
        name, child = next(iter(pending.items()))
        with contextlib.suppress(TimeoutError):  # a short bounded wait is the poll interval
            child.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=1.0, what=f"{name} leaving")
    for child in pending.values():
        child.proc.send_signal(signal.SIGTERM)
    for child in pending.values():  # it leaves at its round's end; SIGKILL if that is over a minute away
        child.terminate(timeout_s=60.0)
    print(f"  stopped stragglers {sorted(pending)} {grace_s:.0f}s after the first peer finished", flush=True)
    return sorted(pending)


def dump_events(swarm: TestbedSwarm) -> None:
    """Every line every process printed, with arrival times from the release, to LOG_DIR/events.jsonl."""
    with (swarm.log_dir / "events.jsonl").open("w") as f:
        for t, name, line in list(swarm.timeline):
            f.write(json.dumps({"t_s": round(t - swarm.released_at, 3), "proc": name, **_line_dict(line)}) + "\n")


def heal_accounting(events_jsonl: Path, workload: Workload) -> dict[str, int]:
    """Heals and the size of what each streams (θ_global and outer momentum, fp32: 8 bytes per parameter).

    A round line's bytes are the peer's data-plane counter over its averaging call, so a state served
    to a healer during that call is in them and one served during inner steps is not: runs with heals
    have no exact own count of their wire bytes, and the table says how many heals there were.
    """
    heals = sum(1 for line in events_jsonl.read_text().splitlines() if json.loads(line).get("event") == "heal")
    numel = sum(p.numel() for p in build_model(workload.config().model, seed=0).parameters())
    return {"heals": heals, "heal_bytes": heals * 8 * numel}


def send_spread(events_jsonl: Path) -> dict[str, float | None]:
    """How far apart the peers' Δs went out: a round's mean lands on every member at about one moment, so the
    spread (max − min) of its members' `comm_s` is the spread of their sends. The median over the rounds
    every peer committed (None: no such round); diloco.pace_align lines the sends up."""
    comm: dict[int, dict[str, float]] = {}
    for text in events_jsonl.read_text().splitlines():
        line = json.loads(text)
        if line.get("event") == "round" and line.get("committed"):
            comm.setdefault(line["round"], {})[line["peer"]] = line["comm_s"]
    peers = max((len(c) for c in comm.values()), default=0)
    spreads = [max(c.values()) - min(c.values()) for c in comm.values() if peers > 1 and len(c) == peers]
    return {"send_spread_s_median": statistics.median(spreads) if spreads else None}


def _line_dict(line: Line) -> dict[str, Any]:
    return {"ready": line.info} if isinstance(line, ReadyLine) else {"event": line.event, **dataclasses.asdict(line)}


def summarize_rounds(swarm: TestbedSwarm, names: list[str]) -> dict[str, Any]:
    """Per-peer wall/compute from its lines; per-round hash agreement across every peer and restart."""
    by_round: dict[int, set[str]] = {}
    compute, wall, steps, sent, received, rounds_done, attempted = [], [], [], 0, 0, [], 0
    first_ready, last_round = float("inf"), 0.0
    for name in names:
        lines = swarm.lines_of(name)
        ready_t = [max(t, swarm.released_at) for t, x in lines if isinstance(x, ReadyLine)]
        rounds = [(t, x) for t, x in lines if isinstance(x, RoundEvent)]
        if not rounds:
            raise RuntimeError(f"{name} printed no round lines; see {swarm.log_dir}")
        for _, e in rounds:
            if e.committed:
                by_round.setdefault(e.round, set()).add(e.hash)
        compute.append(sum(e.compute_s for _, e in rounds))
        steps.append(sum(e.steps for _, e in rounds))  # inner steps trained (a retried Δ counts once)
        wall.append(rounds[-1][0] - ready_t[0])
        first_ready, last_round = min(first_ready, ready_t[0]), max(last_round, rounds[-1][0])
        attempted += len(rounds)
        leaves = [x for _, x in lines if isinstance(x, LeaveEvent)]  # bytes after the last round line
        sent += sum(e.bytes_sent for _, e in rounds) + sum(e.bytes_sent for e in leaves)
        received += sum(e.bytes_received for _, e in rounds) + sum(e.bytes_received for e in leaves)
        rounds_done.append(sum(e.committed for _, e in rounds))
    disagree = {r: sorted(h) for r, h in by_round.items() if len(h) > 1}
    # A round's wall time: from one commit line of a peer to its next (its inner steps and everything else);
    # outside compute: the round line's comm_s (matchmaking, the all-reduce, the decision, the outer step).
    gaps, comm = [], []
    for name in names:
        committed = [(t, e) for t, e in swarm.lines_of(name) if isinstance(e, RoundEvent) and e.committed]
        gaps += [b[0] - a[0] for a, b in itertools.pairwise(committed)]
        comm += [e.comm_s for _, e in committed]
    return {
        "wall_s": last_round - first_ready, "wall_s_per_peer": wall, "rounds_attempted": attempted,
        "compute_s": compute, "utilization": [c / w for c, w in zip(compute, wall, strict=True)],
        "steps_per_peer": steps, "committed_rounds_per_peer": rounds_done, "rounds_committed": len(by_round),
        "rounds_with_disagreeing_hashes": disagree, "swarmtrain_bytes_sent": sent,
        "swarmtrain_bytes_received": received,
        "round_s_median": statistics.median(gaps) if gaps else None,
        "comm_s_median": statistics.median(comm) if comm else None,
    }

