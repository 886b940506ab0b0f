"""The all-reduce round as the swarm grows, with real peer processes on the namespace testbed (needs root).

`sizes`: for each swarm size N, one run of the same per-peer workload (coordinator on host 0, peer i on host i,
100 Mbit/s links). Per peer and round, from the peers' own round lines: the control plane (DHT lookups, stores,
values returned, records opened: discovery.DirectoryIo), data-plane bytes sent and received, and the seconds
outside the inner steps (comm_s: matchmaking, the all-reduce, the decision, the outer step); from /proc: CPU
seconds per round of each peer's DHT processes (hivemind's DHT process and its p2pd: the control plane's CPU)
and of the whole peer. Each figure's growth with N is fitted as a power law, N^k (k = 0: flat, 1: linear).

`kill`: N peers (default 16); in each of `--kills` rounds one peer that reduces a shard is SIGKILLed right after
its reducer closed the shard (the agreement on the round's contributors is done, the means are being served),
then restarted from its checkpoint (one kill a round, the next once the round of the last committed). Reported:
whether each of those rounds committed, with one hash and no aborted attempt, on every peer that was up through
it (all but its victim and the last round's, which is still restarting), and every aborted round of the run with
its reason.

  sudo .venv/bin/python benchmarks/scale.py sizes --peers 4 8 16 24
  sudo .venv/bin/python benchmarks/scale.py kill --peers 16 --kills 10
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from wan_common import DilocoRun, Workload, finish_diloco, start_diloco

from swarmtrain.daemon.cli import LOG_LEVEL_ENV
from swarmtrain.telemetry.events import RoundEvent
from swarmtrain.testbed import LinkSpec, Testbed, parse_rate, read_counters, require_root

WAIT_S = 900.0  # the longest any one wait lasts
PER_ROUND = ("dht_reads", "dht_writes", "dht_slots", "dht_decoded", "bytes_sent", "bytes_received", "comm_s")
CLOSED = re.compile(r"closed shard (\d+) of round (\d+) attempt (\d+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("sizes", "kill"))
    p.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16, 24], help="swarm sizes (kill: the first)")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round trip between hosts (each end holds RTT/4)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8, help="sizes: rounds per run; kill: rounds after the warm ones")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--matchmaking-s", type=float, default=5.0)
    p.add_argument("--kills", type=int, default=10, help="kill: rounds in which a reducer is killed")
    p.add_argument("--warm-rounds", type=int, default=2, help="kill: rounds before the first kill")
    p.add_argument("--name", default="scale")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of one run")
    p.add_argument("--out", default="")
    p.add_argument("--from-json", action="store_true", help="kill: no run, recompute --out's summary from its logs")
    return p.parse_args(argv)


def _extra(args: argparse.Namespace) -> list[str]:
    return ["averaging.min_peers=2", f"averaging.matchmaking_timeout_s={args.matchmaking_s}"]


def _workload(args: argparse.Namespace, peers: int, rounds: int) -> Workload:
    return Workload(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, rounds=rounds,
                    inner_steps=args.inner_steps, num_peers=peers, corpus_bytes=2_000_000)


def _link(args: argparse.Namespace) -> LinkSpec:
    return LinkSpec(rate_bit_s=parse_rate(args.rate), delay_ms=args.rtt_ms / 4)


class CpuMeter:
    """CPU seconds of each peer's process tree, split into the peer's main process and its descendants (the DHT
    process and p2pd), sampled while they run: the highest of each over the samples."""

    def __init__(self, run: DilocoRun, *, every_s: float = 2.0) -> None:
        self.run, self.every_s = run, every_s
        self.last: dict[str, tuple[float, float]] = {}  # peer -> (main, children) CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, child in list(self.run.swarm.peers.items()):
                sample = _tree_cpu(child.proc.pid)
                if sample is not None:  # a leaving peer's DHT ends before it does: keep the highest counts
                    before = self.last.get(name, (0.0, 0.0))
                    self.last[name] = (max(before[0], sample[0]), max(before[1], sample[1]))


def _tree_cpu(pid: int) -> tuple[float, float] | None:
    """(the peer's own CPU s, its descendants' CPU s): `ip netns exec` execs the peer, so `pid` is the peer."""
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        main = t.user + t.system
        kids = t.children_user + t.children_system  # descendants already ended and reaped
        for c in proc.children(recursive=True):
            with_times = c.cpu_times()
            kids += with_times.user + with_times.system
        return main, kids
    except psutil.Error:
        return None


def _power_law(ns: list[int], ys: list[float]) -> float | None:
    """k of y ≈ a·N^k, least squares in log-log (None when a value is not positive)."""
    if len(ns) < 2 or any(y <= 0 for y in ys):
        return None
    slope, _ = statistics.linear_regression([math.log(n) for n in ns], [math.log(y) for y in ys])
    return slope


def sizes(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs = []
    for n in args.peers:
        workload = _workload(args, n, args.rounds)
        print(f"[{time.strftime('%H:%M:%S')}] {n} peers ...", flush=True)
        with Testbed(args.name, num_hosts=n, link=_link(args)) as tb:
            before = read_counters(tb.name)
            run = start_diloco(tb, workload, codec="int8", out_dir=work / f"peers-{n}", extra_run=_extra(args))
            try:
                with CpuMeter(run) as cpu:
                    result = finish_diloco(run, workload, timeout_s=args.timeout_s, before=before)
            finally:
                run.swarm.close()
        per_peer: dict[str, list[float]] = {k: [] for k in PER_ROUND}
        lines = [e for name in run.hosts for _, e in run.swarm.lines_of(name) if isinstance(e, RoundEvent)]
        # The first round's line also holds the peer's start (its first reads of the swarm): left out.
        steady = [e for e in lines if e.round > 0]
        for key in PER_ROUND:
            per_peer[key] = [float(getattr(e, key) or 0) for e in steady]
        rounds_per_peer = {name: max(1, sum(1 for _, e in run.swarm.lines_of(name)
                                            if isinstance(e, RoundEvent) and e.committed)) for name in run.hosts}
        cpu_main = [cpu.last.get(name, (0.0, 0.0))[0] / rounds_per_peer[name] for name in run.hosts]
        cpu_dht = [cpu.last.get(name, (0.0, 0.0))[1] / rounds_per_peer[name] for name in run.hosts]
        row: dict[str, Any] = {
            "peers": n, "rounds_committed": result["rounds_committed"],
            "rounds_attempted": result["rounds_attempted"],
            "rounds_with_disagreeing_hashes": result["rounds_with_disagreeing_hashes"],
            "aborted": [(e.peer[:12], e.round, e.reason) for e in lines if not e.committed],
            "cpu_s_per_round_peer_median": statistics.median(cpu_main),
            "cpu_s_per_round_dht_median": statistics.median(cpu_dht),
            "compute_s_per_round_median": statistics.median(
                [c / rounds_per_peer[name] for c, name in zip(result["compute_s"], run.hosts, strict=True)]),
            "val_loss": result["val_loss"], "wall_s": result["wall_s"],
        }
        for key, values in per_peer.items():
            row[f"{key}_per_round_median"] = statistics.median(values) if values else None
            row[f"{key}_per_round_max"] = max(values) if values else None
        runs.append(row)
        print(f"  committed {row['rounds_committed']} rounds; per peer per round: DHT "
              f"{row['dht_reads_per_round_median']:.0f} reads / {row['dht_writes_per_round_median']:.0f} writes / "
              f"{row['dht_slots_per_round_median']:.0f} values / {row['dht_decoded_per_round_median']:.0f} decoded, "
              f"{row['bytes_sent_per_round_median'] / 1e6:.2f} MB sent, outside compute "
              f"{row['comm_s_per_round_median']:.2f} s, CPU {row['cpu_s_per_round_peer_median']:.2f} s "
              f"(DHT processes {row['cpu_s_per_round_dht_median']:.2f} s)", flush=True)
    ns = [r["peers"] for r in runs]
    growth = {}
    for key in [*(f"{k}_per_round_median" for k in PER_ROUND), "cpu_s_per_round_peer_median",
                "cpu_s_per_round_dht_median"]:
        growth[key] = _power_law(ns, [float(r[key] or 0) for r in runs])
    print("growth with N (y ≈ a·N^k): " + ", ".join(f"{k} k={'-' if v is None else f'{v:.2f}'}"
                                                  for k, v in growth.items()))
    return {"runs": runs, "growth_exponent": growth}


def _watch_closed(run: DilocoRun, name: str, *, after_round: int, timeout_s: float) -> tuple[int, int] | None:
    """Wait until peer `name`'s log says it closed a shard of a round > `after_round`: (round, shard)."""
    child = run.swarm.peers[name]
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        if not child.alive:
            return None
        text = child.log_path.read_text(errors="replace")
        for m in CLOSED.finditer(text, seen):
            shard, r = int(m.group(1)), int(m.group(2))
            if r > after_round:
                return r, shard
        seen = max(0, len(text) - 200)
        time.sleep(0.02)
    return None


def _latest_round(run: DilocoRun) -> int:
    rounds = [e.round for name in run.hosts for _, e in run.swarm.lines_of(name)
              if isinstance(e, RoundEvent) and e.committed]
    return max(rounds, default=-1)


def kill(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    n = args.peers[0]
    rounds = args.warm_rounds + args.rounds + 2 * args.kills
    workload = _workload(args, n, rounds)
    kills: list[dict[str, Any]] = []
    with Testbed(args.name, num_hosts=n, link=_link(args)) as tb:
        before = read_counters(tb.name)
        run = start_diloco(tb, workload, codec="int8", out_dir=work / "kill", extra_run=_extra(args),
                           checkpoint_every=1, env={LOG_LEVEL_ENV: "INFO"})
        try:
            run.swarm.peers["p0"].wait_for(
                lambda x: isinstance(x, RoundEvent) and x.committed and x.round >= args.warm_rounds - 1,
                timeout_s=WAIT_S, what="p0's warm rounds")
            victims = [f"p{1 + i % (n - 1)}" for i in range(args.kills)]
            last = -1
            for victim in victims:
                # one kill a round: the next in a round after the last kill's, once that one committed somewhere
                found = _watch_closed(run, victim, after_round=max(last, _latest_round(run)), timeout_s=WAIT_S)
                if found is None:
                    print(f"  {victim} closed no shard in time (or died): skipped", flush=True)
                    continue
                r, shard = found
                run.swarm.peers[victim].kill()
                print(f"[{time.strftime('%H:%M:%S')}] killed {victim}, reducer of shard {shard}, in round {r}",
                      flush=True)
                run.restart(victim)
                kills.append({"victim": victim, "round": r, "shard": shard,
                              "restarting": kills[-1]["victim"] if kills else None})
                last = r
                run.swarm.peers["p0"].wait_for(
                    lambda x, r=r: isinstance(x, RoundEvent) and x.committed and x.round >= r,
                    timeout_s=WAIT_S, what=f"p0's commit of round {r}")
            result = finish_diloco(run, workload, timeout_s=args.timeout_s, before=before)
        finally:
            run.swarm.close()
    lines = [(name, e) for name in run.hosts for _, e in run.swarm.lines_of(name) if isinstance(e, RoundEvent)]
    out = summarize_kills(lines, kills)
    out.update(peers=n, rounds_with_disagreeing_hashes=result["rounds_with_disagreeing_hashes"],
               rounds_committed=result["rounds_committed"], val_loss=result["val_loss"])
    return out


def _late(reason: str) -> bool:
    """A peer that reached the round after its window closed (a restarted one) or was left out of its group: it
    heals or retries, and the round did not fail for it."""
    return reason.startswith(("no group: late", "no group: not in leader"))


def summarize_kills(lines: list[tuple[str, RoundEvent]], kills: list[dict[str, Any]]) -> dict[str, Any]:
    """For each killed round: of the peers that reached it (a line for it; its victim aside), how many committed
    it, with how many hashes, and how many ended an attempt at it for another reason than arriving late."""
    for k in kills:
        at = [(name, e) for name, e in lines if e.round == k["round"] and name != k["victim"]]
        reached = {name for name, _ in at}
        committed = {name for name, e in at if e.committed}
        failed = [(name, e.reason) for name, e in at if not e.committed and not _late(e.reason)]
        k.update(reached=len(reached), committed_on=len(committed), failed=failed,
                 late=sum(1 for _, e in at if not e.committed and _late(e.reason)),
                 hashes=len({e.hash for _, e in at if e.committed}),
                 comm_s_median=statistics.median([e.comm_s for _, e in at if e.committed] or [0.0]))
    ok = [k for k in kills if k["committed_on"] and not k["failed"] and k["hashes"] == 1]
    killed = {k["round"] for k in kills}
    quiet = [e.comm_s for _, e in lines if e.committed and e.round not in killed and e.round > 0]
    quiet_s = statistics.median(quiet) if quiet else None
    print(f"{len(ok)} of {len(kills)} rounds with a reducer killed committed with one hash and no peer's attempt at "
          "them failing (peers that came late, restarting, heal or retry); time outside compute, median: "
          f"{statistics.median([k['comm_s_median'] for k in kills]):.2f} s in those rounds, "
          f"{'-' if quiet_s is None else f'{quiet_s:.2f}'} s in the others")
    for k in kills:
        print(f"  round {k['round']}: {k['victim']} (shard {k['shard']}) killed; {k['committed_on']} of the "
              f"{k['reached']} other peers that reached it committed it ({k['hashes']} hash), {k['late']} late "
              f"arrivals, failed attempts: {k['failed'] or 'none'}")
    return {"kills": kills, "rounds_ok": len(ok), "comm_s_median_other_rounds": quiet_s,
            "aborted_lines": [(name, e.round, e.reason) for name, e in lines if not e.committed]}


def from_json(path: Path) -> dict[str, Any]:
    """Recompute a kill run's summary from its results JSON and its peers' round lines (events.jsonl)."""
    doc = json.loads(path.read_text())
    events = path.parent / f"{path.stem}-runs" / "kill" / "logs" / "events.jsonl"
    lines = []
    for raw in events.read_text().splitlines():
        d = json.loads(raw)
        if d.get("event") == "round" and d["proc"].startswith("p"):
            fields = {k: v for k, v in d.items() if k not in ("t_s", "proc", "event")}
            fields["members"] = tuple(fields.get("members", ()))
            lines.append((d["proc"], RoundEvent(**fields)))
    doc.update(summarize_kills(lines, [{k: v for k, v in x.items() if k in ("victim", "round", "shard")}
                                       for x in doc["kills"]]))
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        out = Path(args.out or f"benchmarks/results/scale-{args.what}.json")
        out.write_text(json.dumps(from_json(out), indent=1) + "\n")
        return 0
    require_root()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out or f"benchmarks/results/scale-{args.what}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f"{out.stem}-runs"
    doc = sizes(args, work) if args.what == "sizes" else kill(args, work)
    doc.update(command=" ".join(sys.argv), rate=args.rate, rtt_ms=args.rtt_ms, preset=args.preset,
               inner_steps=args.inner_steps, batch_size=args.batch_size, seq_len=args.seq_len,
               matchmaking_s=args.matchmaking_s,
               machine="2-core x86 CPU machine: every peer's processes share the 2 cores")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
