"""Gossip (NoLoCo) against the all-reduce with real peer processes on the namespace testbed (needs root).

`scale`: for each swarm size, one run per mode (allreduce, gossip) of the same workload; reports the
seconds each peer spends outside its inner steps per round (wall − compute over its rounds: matchmaking,
the all-reduce or the exchange, the outer step), median and worst over the peers, and a written model:
that cost fitted as a + b·N for each mode and extrapolated to 100 and 1,000 peers.

`chaos`: 6 gossip peers; once p0 has trained `--warm-rounds`, p1 is SIGSTOPped for `--stop-s` seconds and p2
is SIGKILLed `--kill-after-s` into the stall and restarted from its checkpoint at once. Reports, for each
other peer, its inner steps per minute during the stall against the same run before the faults (target
≥ 95%), its longest wait for its partners' parts in one round during the stall (target ≤ one
gossip_timeout_s) and its longest time outside compute in one round (that wait plus the round's own work:
Δ, encoding, the roster read, the step), whether the restarted peer trained again, and the swarm's spread before the
faults against the spread 10 rounds after SIGCONT.

  sudo .venv/bin/python benchmarks/gossip_testbed.py scale --peers 4 8 16
  sudo .venv/bin/python benchmarks/gossip_testbed.py chaos
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from wan_common import DilocoRun, Workload, finish_diloco, start_diloco

from swarmtrain.telemetry.events import RoundEvent
from swarmtrain.testbed import LinkSpec, Testbed, parse_rate, read_counters, require_root

WAIT_S = 600.0  # the longest any one wait of the schedule lasts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("scale", "chaos"))
    p.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16], help="scale: swarm sizes")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--gossip-timeout-s", type=float, default=5.0)
    p.add_argument("--matchmaking-s", type=float, default=3.0, help="the all-reduce arm's matchmaking window")
    p.add_argument("--warm-rounds", type=int, default=5, help="chaos: rounds p0 trains before the faults")
    p.add_argument("--chaos-rounds", type=int, default=200,
                   help="chaos: rounds after the warm ones; enough that the others still train 10 rounds after "
                        "SIGCONT (a round of the defaults takes about a second)")
    p.add_argument("--stop-s", type=float, default=60.0, help="chaos: how long p1 stays stopped")
    p.add_argument("--kill-after-s", type=float, default=10.0, help="chaos: when p2 is killed, into the stall")
    p.add_argument("--name", default="gossip")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of one run")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def _extra(mode: str, args: argparse.Namespace) -> list[str]:
    return [f'averaging.mode="{mode}"', "averaging.min_peers=2", f"averaging.gossip_timeout_s={args.gossip_timeout_s}",
            f"averaging.matchmaking_timeout_s={args.matchmaking_s}"]


def _workload(args: argparse.Namespace, peers: int, rounds: int) -> Workload:
    return Workload(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, rounds=rounds,
                    inner_steps=args.inner_steps, num_peers=peers, corpus_bytes=2_000_000)


def _outside_per_round(result: dict[str, Any]) -> list[float]:
    return [(w - c) / max(1, r) for w, c, r in zip(result["wall_s_per_peer"], result["compute_s"],
                                                    result["committed_rounds_per_peer"], strict=True)]


def scale(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs = []
    for n in args.peers:
        workload = _workload(args, n, args.rounds)
        for mode in ("allreduce", "gossip"):
            print(f"[{time.strftime('%H:%M:%S')}] {n} peers, {mode} ...", flush=True)
            with Testbed(args.name, num_hosts=n, link=LinkSpec(rate_bit_s=parse_rate(args.rate))) as tb:
                before = read_counters(tb.name)
                run = start_diloco(tb, workload, codec="int8", out_dir=work / f"{mode}-{n}",
                                   extra_run=_extra(mode, args))
                try:
                    result = finish_diloco(run, workload, timeout_s=args.timeout_s, before=before)
                finally:
                    run.swarm.close()
            outside = _outside_per_round(result)
            runs.append({"peers": n, "mode": mode, "outside_s_per_round_median": statistics.median(outside),
                         "outside_s_per_round_max": max(outside), "outside_s_per_round": outside,
                         "val_loss": result["val_loss"], "wall_s": result["wall_s"],
                         "bytes_sent_per_peer_per_round": result["swarmtrain_bytes_sent"] / n / args.rounds})
            print(f"  outside compute per round: median {runs[-1]['outside_s_per_round_median']:.2f} s, worst "
                  f"{runs[-1]['outside_s_per_round_max']:.2f} s; val {result['val_loss']:.4f}", flush=True)
    model = {}
    for mode in ("allreduce", "gossip"):
        xs = [r["peers"] for r in runs if r["mode"] == mode]
        ys = [r["outside_s_per_round_median"] for r in runs if r["mode"] == mode]
        if len(xs) >= 2:
            slope, intercept = statistics.linear_regression(xs, ys)
        else:
            slope, intercept = 0.0, ys[0]
        model[mode] = {"a_s": intercept, "b_s_per_peer": slope,
                       "at_100": intercept + 100 * slope, "at_1000": intercept + 1000 * slope}
        print(f"{mode}: outside compute per round ≈ {intercept:.2f} s + {slope:.3f} s × N -> "
              f"{model[mode]['at_100']:.1f} s at 100 peers, {model[mode]['at_1000']:.1f} s at 1,000")
    return {"runs": runs, "model": model}


def _rounds(run: DilocoRun, name: str) -> list[tuple[float, RoundEvent]]:
    return [(t, x) for t, x in run.swarm.lines_of(name) if isinstance(x, RoundEvent) and x.committed]


def _wait_round(run: DilocoRun, name: str, at_least: int) -> None:
    run.swarm.peers[name].wait_for(lambda x: isinstance(x, RoundEvent) and x.committed and x.round >= at_least,
                                   timeout_s=WAIT_S, what=f"{name}'s round {at_least}")


def chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rounds = args.warm_rounds + args.chaos_rounds
    workload = _workload(args, 6, rounds)
    with Testbed(args.name, num_hosts=6, link=LinkSpec(rate_bit_s=parse_rate(args.rate))) as tb:
        before = read_counters(tb.name)
        run = start_diloco(tb, workload, codec="int8", out_dir=work / "chaos", extra_run=_extra("gossip", args),
                           checkpoint_every=1)
        try:
            _wait_round(run, "p0", args.warm_rounds)
            stop_at = time.monotonic()
            run.swarm.peers["p1"].signal_group(signal.SIGSTOP)
            time.sleep(args.kill_after_s)
            run.swarm.peers["p2"].kill()
            run.restart("p2")
            restarted_at = time.monotonic()
            time.sleep(max(0.0, stop_at + args.stop_s - time.monotonic()))
            run.swarm.peers["p1"].signal_group(signal.SIGCONT)
            resumed_at = time.monotonic()
            result = finish_diloco(run, workload, timeout_s=args.timeout_s, before=before)
        finally:
            run.swarm.close()
    stall = (stop_at, stop_at + args.stop_s)
    others = {}
    for name in ("p0", "p3", "p4", "p5"):
        lines = _rounds(run, name)
        start = run.swarm.released_at
        before_steps = sum(x.steps for t, x in lines if start <= t < stall[0])
        during = [(t, x) for t, x in lines if stall[0] <= t < stall[1]]
        rate_before = before_steps / max(1e-9, stall[0] - start) * 60
        rate_during = sum(x.steps for _, x in during) / (stall[1] - stall[0]) * 60
        others[name] = {"steps_per_min_before": rate_before, "steps_per_min_during": rate_during,
                        "ratio": rate_during / rate_before if rate_before else None,
                        "max_comm_s_during": max((x.comm_s for _, x in during), default=0.0),
                        "max_wait_s_during": max((x.wait_s or 0.0 for _, x in during), default=0.0)}
    spreads = {}
    for name in ("p0", "p3", "p4", "p5"):
        lines = _rounds(run, name)
        pre = [x.spread for t, x in lines if t < stall[0] and x.spread is not None][-10:]
        after = [x.spread for t, x in lines if t >= resumed_at and x.spread is not None]
        spreads[name] = {"before": statistics.mean(pre) if pre else None,
                         "10_rounds_after_resume": statistics.mean(after[5:10]) if len(after) >= 10 else None}
    early = [n for n in ("p0", "p3", "p4", "p5") if not any(t >= resumed_at for t, _ in _rounds(run, n))]
    if early:  # their rate during the stall would count the time after their last round
        print(f"INVALID: {early} trained their last round before p1 resumed: raise --chaos-rounds", flush=True)
    back = [x for t, x in _rounds(run, "p2") if t >= restarted_at]
    out = {"others": others, "spread": spreads, "restarted_rounds": len(back), "finished_before_resume": early,
           "restarted_first_round": back[0].round if back else None,
           "stopped_rounds_after_resume": sum(1 for t, _ in _rounds(run, "p1") if t >= resumed_at),
           "val_loss": result["val_loss"], "gossip_timeout_s": args.gossip_timeout_s}
    worst = min((o["ratio"] for o in others.values() if o["ratio"] is not None), default=float("nan"))
    print(f"worst other peer's steps/min during the stall: {worst:.3f}x of before (target >= 0.95); longest wait "
          f"for partners: {max(o['max_wait_s_during'] for o in others.values()):.2f} s (gossip_timeout_s "
          f"{args.gossip_timeout_s}), longest round outside compute: "
          f"{max(o['max_comm_s_during'] for o in others.values()):.2f} s; p2 trained {len(back)} rounds after its "
          f"restart; spread {spreads}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_root()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out or f"benchmarks/results/gossip-testbed-{args.what}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f"{out.stem}-runs"
    doc = scale(args, work) if args.what == "scale" else chaos(args, work)
    doc.update(command=" ".join(sys.argv), rate=args.rate, preset=args.preset, inner_steps=args.inner_steps)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
