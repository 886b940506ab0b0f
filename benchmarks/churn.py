"""DiLoCo under churn on the namespace testbed (needs root): the wan.py DiLoCo run, failure-free and with faults.

The faulty run, on a schedule keyed to peer p0's round lines (every wait has a deadline):
  * after round K1 commits: SIGKILL peer p3's whole process group (a crashed machine);
    after p0 commits one more round without it: restart p3 from its checkpoint (it heals);
  * after round K2 commits: SIGSTOP peer p2's group (a hung machine) until p0 commits
    --stop-rounds more rounds without it, then SIGCONT (it heals).
Reported against the failure-free run: final val loss of θ_global, committed tokens per second,
wall-clock; and for both: every round that committed anywhere maps to one θ_global hash.

  sudo .venv/bin/python benchmarks/churn.py                    # the README figures
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from wan_common import DilocoRun, Workload, finish_diloco, start_diloco

from swarmtrain.process.children import Child
from swarmtrain.telemetry.events import Line, RoundEvent
from swarmtrain.testbed import LinkSpec, Testbed, parse_rate, read_counters, require_root

ROUND_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--codec", default="int8")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--peer-data", choices=("sharded", "independent"), default="sharded",
                   help="sharded (default): peer k reads DDP rank k's slot of the data; independent: each peer "
                        "its own permutation, like an open swarm with no roster")
    p.add_argument("--kill-after", type=int, default=2, help="K1: SIGKILL p3 after this round commits")
    p.add_argument("--stop-after", type=int, default=5, help="K2: SIGSTOP p2 after this round commits")
    p.add_argument("--stop-rounds", type=int, default=2, help="rounds p0 commits while p2 is stopped")
    p.add_argument("--matchmaking-s", type=float, default=3.0,
                   help="averaging.matchmaking_timeout_s (with early close, only how long stragglers get)")
    p.add_argument("--overlap", action="store_true",
                   help="diloco.overlap: average each round while the next one trains (use a longer --matchmaking-s)")
    p.add_argument("--allreduce-timeout-s", type=float, default=10.0, help="a stopped peer's deadline")
    p.add_argument("--contribution-window-s", type=float, default=5.0,
                   help="averaging.contribution_window_s (must be shorter than --allreduce-timeout-s)")
    p.add_argument("--name", default="churn")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default="benchmarks/results/churn.json")
    return p.parse_args(argv)


def _committed_round(child: Child, *, at_least: int, start: int = 0) -> int:
    """Index of `child`'s first committed round line with round >= `at_least` (from line `start`)."""
    def match(x: Line) -> bool:
        return isinstance(x, RoundEvent) and x.committed and x.round >= at_least
    index, _ = child.wait_for(match, timeout_s=ROUND_TIMEOUT_S, start=start, what=f"a committed round >= {at_least}")
    return index


def _newest_round(child: Child) -> int:
    return max((x.round for x in child.snapshot() if isinstance(x, RoundEvent) and x.committed), default=-1)


def chaos(run: DilocoRun, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The fault schedule; returns what was done and when (monotonic seconds from its start)."""
    p0 = run.swarm.peers["p0"]
    t0 = time.monotonic()
    log: list[dict[str, Any]] = []

    def note(action: str, peer: str) -> None:
        log.append({"t_s": round(time.monotonic() - t0, 2), "action": action, "peer": peer,
                    "p0_round": _newest_round(p0)})
        print(f"  [{log[-1]['t_s']:7.1f}s] {action} {peer} (p0 at round {log[-1]['p0_round']})", flush=True)

    _committed_round(p0, at_least=args.kill_after)
    run.swarm.peers["p3"].kill()
    note("SIGKILL", "p3")
    _committed_round(p0, at_least=_newest_round(p0) + 1)
    run.restart("p3")
    note("restart", "p3")
    _committed_round(p0, at_least=args.stop_after)
    p2 = run.swarm.peers["p2"]
    p2.signal_group(signal.SIGSTOP)
    note("SIGSTOP", "p2")
    _committed_round(p0, at_least=_newest_round(p0) + args.stop_rounds)
    p2.signal_group(signal.SIGCONT)
    note("SIGCONT", "p2")
    return log


def one_run(label: str, workload: Workload, args: argparse.Namespace, out_dir: Path, *, faults: bool) -> dict[str, Any]:
    print(f"[{time.strftime('%H:%M:%S')}] {label} ...", flush=True)
    extra = [f"averaging.matchmaking_timeout_s={args.matchmaking_s}", "averaging.min_peers=2",
             f"averaging.allreduce_timeout_s={args.allreduce_timeout_s}",
             f"averaging.contribution_window_s={args.contribution_window_s}",
             f"diloco.overlap={'true' if args.overlap else 'false'}"]
    with Testbed(args.name, num_hosts=workload.num_peers, link=LinkSpec(rate_bit_s=parse_rate(args.rate))) as tb:
        before = read_counters(tb.name)
        run = start_diloco(tb, workload, codec=args.codec, out_dir=out_dir, extra_run=extra, checkpoint_every=1)
        try:
            schedule = chaos(run, args) if faults else []
            result = finish_diloco(run, workload, timeout_s=args.timeout_s, before=before)
        finally:
            run.swarm.close()
    committed_tokens = _committed_tokens(run, workload)
    result.update(label=label, faults=schedule, committed_tokens=committed_tokens,
                  tokens_per_s=committed_tokens / result["wall_s"])
    print(f"  wall {result['wall_s']:.1f}s val {result['val_loss']:.4f} tok/s {result['tokens_per_s']:.0f} "
          f"rounds {result['rounds_committed']} disagreeing {result['rounds_with_disagreeing_hashes']}", flush=True)
    return result


def _committed_tokens(run: DilocoRun, workload: Workload) -> int:
    """Tokens that entered θ_global: per committed round, its members x H x batch x seq_len."""
    members: dict[int, int] = {}
    for name in run.hosts:
        for _, x in run.swarm.lines_of(name):
            if isinstance(x, RoundEvent) and x.committed:
                members[x.round] = max(members.get(x.round, 0), len(x.members))
    return sum(members.values()) * workload.inner_steps * workload.batch_size * workload.seq_len


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_root()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not 0 < args.kill_after < args.stop_after < args.rounds - args.stop_rounds - 1:
        raise SystemExit("need 0 < --kill-after < --stop-after < --rounds - --stop-rounds - 1")
    workload = Workload(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, rounds=args.rounds,
                        inner_steps=args.inner_steps, num_peers=4, peer_data=args.peer_data)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f"{out.stem}-runs"
    clean = one_run("failure-free", workload, args, work / "clean", faults=False)
    faulty = one_run("kill+stop", workload, args, work / "faulty", faults=True)
    doc = {"workload": workload.__dict__, "rate": args.rate, "codec": args.codec, "command": " ".join(sys.argv),
           "failure_free": clean, "with_faults": faulty,
           "val_loss_rel_diff": faulty["val_loss"] / clean["val_loss"] - 1,
           "tokens_per_s_ratio": faulty["tokens_per_s"] / clean["tokens_per_s"]}
    out.write_text(json.dumps(doc, indent=1))
    print(f"\n{'run':>13} {'wall s':>8} {'val loss':>9} {'tok/s':>8} {'rounds':>7} {'disagreeing rounds':>19}")
    for r in (clean, faulty):
        print(f"{r['label']:>13} {r['wall_s']:8.1f} {r['val_loss']:9.4f} {r['tokens_per_s']:8.0f} "
              f"{r['rounds_committed']:7d} {len(r['rounds_with_disagreeing_hashes']):19d}")
    print(f"val loss with faults {100 * doc['val_loss_rel_diff']:+.2f}% vs failure-free; "
          f"tokens/s {doc['tokens_per_s_ratio']:.3f}x\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
