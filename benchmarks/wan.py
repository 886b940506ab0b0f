"""DiLoCo vs data-parallel training on shaped links: 4 namespace hosts at 100 and 20 Mbit/s (needs root).

Arms, each on a fresh testbed, the same model, seed and number of tokens: `ddp`, or a codec followed
by modes, CODEC[-overlap][-frag][-time]:
  ddp   torch.distributed gloo, one rank per host, a fp32 gradient all-reduce every step
  fp32  swarmtrain DiLoCo, H inner steps, fp32 pseudo-gradients
  int8  swarmtrain DiLoCo, int8 pseudo-gradients
  sparse     the sparse codec (1% of each chunk at 2 bits, error feedback; --diloco-set compress.* to change)
  -overlap   diloco.overlap: round r is averaged while round r+1's inner steps run
  -frag      Streaming DiLoCo: θ in --fragments fragments, one synced per round after H/P steps
  -time      diloco.pace=time: each round every peer trains for one shared span (H steps at the group's
             median rate) instead of exactly H steps, so no peer waits for the slowest
Reported per arm: wall-clock, compute utilization (compute s / wall s per process), bytes on the wire
(kernel htb counters: all traffic, the data-plane port's frames, their TCP payload) next to what
swarmtrain counted, the peak link rate (each host's interface counters sampled every 50 ms: the
highest upload and download of any host over 0.5, 1 and 2 s spans), final validation loss of the
trained weights. The machine has 2 cores for 4 hosts:
every process runs 1 torch thread and compute is oversubscribed ~2x (it slows every arm alike).
DiLoCo peer k reads DDP rank k's slot of the data (data.num_shards, --shard-index) unless
--peer-data independent gives each peer its own permutation, as in an open swarm.

  sudo .venv/bin/python benchmarks/wan.py                      # 8 rounds from scratch, both rates
  sudo .venv/bin/python benchmarks/wan.py --rates 100mbit --arms ddp,int8-overlap,int8 --rounds 128 \
      --warm-start-steps 400 --outer-lr 1.0 --out benchmarks/results/wan-128rounds.json   # warm start, 128 steps
  sudo .venv/bin/python benchmarks/wan.py --rates 100mbit --arms int8-time,int8-overlap-time --rounds 128 \
      --warm-start-steps 400 --outer-lr 1.0 --merge --out benchmarks/results/wan-128rounds.json  # time-paced arms
  sudo .venv/bin/python benchmarks/wan.py --rates 100mbit --arms ddp --rounds 128 --warm-start-steps 400 \
      --ddp-set inner.lr=6e-3 --out benchmarks/results/wan-ddp-lr6e-3.json   # DDP at its own tuned lr
  sudo .venv/bin/python benchmarks/wan.py --rates 100mbit --arms int8-time --rounds 128 --warm-start-steps 400 \
      --outer-lr 1.0 --diloco-set inner.lr=1.5e-3 --diloco-set outer.momentum=0.8 \
      --out benchmarks/results/wan-sharded.json   # the tuned DiLoCo setting
  sudo .venv/bin/python benchmarks/wan.py --rates 100mbit --arms int8 --rounds 2   # a quick look
  sudo .venv/bin/python benchmarks/wan.py --rates 100mbit --rtt-ms 0,100 --arms int8,int8-overlap \
      --out benchmarks/results/wan-rtt.json   # the same arms without and with a 100 ms round trip
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
from wan_common import (
    Workload,
    finish_diloco,
    heal_accounting,
    make_warm_start,
    run_ddp,
    send_spread,
    start_diloco,
)

from swarmtrain.testbed import LinkSpec, Testbed, parse_rate, read_counters, require_root
from swarmtrain.testbed.rates import LinkRateSampler

CODECS = ("fp32", "int8", "sparse")
MODES = ("overlap", "frag", "time")  # an arm is CODEC[-MODE]..., modes in this order, or ddp
DEFAULT_ARMS = "ddp,fp32,int8"
PEAK_WINDOWS_S = (0.5, 1.0, 2.0)  # spans of the peak link rates (LinkRateSampler)


def arm_key(arm: str) -> tuple[int, ...]:
    """Sort order: ddp first, then by codec, then by the modes an arm has."""
    if arm == "ddp":
        return (-1,)
    codec, *modes = arm.split("-")
    return (CODECS.index(codec), *(MODES.index(m) + 1 for m in modes))


def check_arm(arm: str) -> None:
    if arm == "ddp":
        return
    codec, *modes = arm.split("-")
    if codec not in CODECS or any(m not in MODES for m in modes) or len(set(modes)) != len(modes) \
            or modes != sorted(modes, key=MODES.index):
        raise SystemExit(f"--arms: {arm!r} is not ddp or CODEC[-MODE]... with CODEC in {CODECS} and MODEs from "
                         f"{MODES} in that order")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,20mbit", help="comma-separated link rates (default: 100mbit,20mbit)")
    p.add_argument("--rtt-ms", default="0",
                   help="comma-separated host-to-host round-trip times; each end of each link holds frames RTT/4 "
                        "(netem, or the testbed's user-space forwarder without it; default: 0)")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated: ddp or CODEC[-MODE]..., CODEC one of "
                   f"{','.join(CODECS)}, MODEs from {','.join(MODES)} in that order (default: {DEFAULT_ARMS})")
    p.add_argument("--preset", default="small", help="model preset (default: small, ~0.85M parameters)")
    p.add_argument("--batch-size", type=int, default=4, help="per-peer batch (default: 4)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8, help="DiLoCo rounds; DDP runs rounds x H steps (default: 8)")
    p.add_argument("--inner-steps", type=int, default=50, help="H (default: 50)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--fragments", type=int, default=4, help="P of the *-frag arms (Streaming DiLoCo; default 4)")
    p.add_argument("--warm-start-steps", type=int, default=0,
                   help="every arm continues from one checkpoint of this many DDP steps (made in-process first)")
    p.add_argument("--peer-data", choices=("sharded", "independent"), default="sharded",
                   help="sharded (default): peer k reads DDP rank k's slot of the data; independent: each peer "
                        "its own permutation, like an open swarm with no roster")
    p.add_argument("--outer-lr", type=float, default=0.0, help="outer.lr of the DiLoCo arms (default: the config's)")
    p.add_argument("--diloco-set", dest="diloco_overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra run config of the DiLoCo arms, e.g. diloco.overlap_max_steps=8")
    p.add_argument("--ddp-set", dest="ddp_overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra run config of the DDP arm (not of the warm start), e.g. inner.lr=6e-3")
    p.add_argument("--matchmaking-s", type=float, default=3.0,
                   help="averaging.matchmaking_timeout_s (with early close, only how long stragglers get)")
    p.add_argument("--overlap-matchmaking-s", type=float, default=20.0,
                   help="the same for the *-overlap arms. There a fast peer posts round r+1 as soon as round r "
                        "lands, up to a whole round of inner steps before the slowest one, so the window must "
                        "outlast a round; waiting in it is hidden behind the next round's inner steps")
    p.add_argument("--name", default="wan", help="testbed name (namespaces NAME-*)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one arm")
    p.add_argument("--out", default="benchmarks/results/wan.json", help="results JSON; the PNG goes next to it")
    p.add_argument("--merge", action="store_true",
                   help="keep the arms already in --out that this invocation does not run")
    p.add_argument("--from-json", action="store_true",
                   help="no runs: re-read --out (and its runs' events.jsonl), print the table, redraw the plot")
    return p.parse_args(argv)


def run_arm(arm: str, rate: str, workload: Workload, args: argparse.Namespace, out_dir: Path, *,
            rtt_ms: float = 0.0) -> dict[str, Any]:
    link = LinkSpec(rate_bit_s=parse_rate(rate), delay_ms=rtt_ms / 4)
    with Testbed(args.name, num_hosts=args.hosts, link=link) as tb:
        result = _run_arm_on(tb, arm, workload, args, out_dir)
        forwarder = tb.forwarder_stats()
        if forwarder is not None:  # what holding the frames in user space cost this arm
            result["delay_forwarder"] = {"cpu_s": forwarder["cpu_s"],
                                         "frames": sum(d["frames"] for p in forwarder["ports"].values()
                                                       for d in p.values()),
                                         "dropped": sum(d["dropped"] for p in forwarder["ports"].values()
                                                        for d in p.values())}
        result["delay_by"] = tb.describe()["link"]["delay_by"]
        return result


def _run_arm_on(tb: Testbed, arm: str, workload: Workload, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    if arm == "ddp":
        return {"overrides": args.ddp_overrides,
                **run_ddp(tb, workload, out_dir=out_dir, timeout_s=args.timeout_s, extra_run=args.ddp_overrides)}
    before = read_counters(tb.name)
    codec, *modes = arm.split("-")
    window_s = args.overlap_matchmaking_s if "overlap" in modes else args.matchmaking_s
    extra = [f"averaging.matchmaking_timeout_s={window_s}", "averaging.min_peers=2",
             f"diloco.overlap={'true' if 'overlap' in modes else 'false'}",
             f"diloco.pace={'time' if 'time' in modes else 'steps'}"]
    if "frag" in modes:  # a round syncs 1/P of θ after H/P steps: P times the rounds for the same tokens
        extra += [f"diloco.fragments={args.fragments}", f"diloco.rounds={workload.rounds * args.fragments}"]
    extra += args.diloco_overrides
    run = start_diloco(tb, workload, codec=codec, out_dir=out_dir, extra_run=extra)
    try:
        with LinkRateSampler([h.netns for h in tb.hosts]) as rates:
            summary = finish_diloco(run, workload, timeout_s=args.timeout_s, before=before)
        peaks = {f"{w:g}": rates.peak_bit_s(window_s=w) for w in PEAK_WINDOWS_S}
        return {"arm": arm, "overrides": extra, **summary, "peak_link_bit_s": peaks}
    finally:
        run.swarm.close()


def link_label(r: dict[str, Any]) -> str:
    """A result's link: its rate, and its round-trip time where one was added."""
    return r["rate"] if not r.get("rtt_ms") else f"{r['rate']} rtt {r['rtt_ms']:g}ms"


def run_dir_name(rate: str, rtt_ms: float, arm: str) -> str:
    return f"{rate}-{arm}" if not rtt_ms else f"{rate}-rtt{rtt_ms:g}-{arm}"


def link_key(r: dict[str, Any]) -> tuple[float, float]:
    return -parse_rate(r["rate"]), r.get("rtt_ms", 0.0)


def _fmt_mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:8.1f}"


def _peak(r: dict[str, Any], window_s: float = 1.0) -> str:
    """The highest rate of any host over `window_s` spans, in its busier direction (sampled arms only):
    classic rounds peak in the download, while members pull the means."""
    peaks = r.get("peak_link_bit_s", {}).get(f"{window_s:g}")
    return "-" if peaks is None else f"{max(peaks.values()) / 1e6:.2f}"


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'link':>20} {'arm':>24} {'wall s':>8} {'util %':>7} {'val loss':>9} {'wire MB':>8} "
          f"{'data MB':>8} {'payload MB':>10} {'counted MB':>10} {'wire/counted':>12} {'payload/counted':>15} "
          f"{'heals':>5} {'peak Mbit/s':>14}")
    for r in results:
        util = 100 * sum(r["utilization"]) / len(r["utilization"])
        counted = r["expected_bytes_sent"] if r["arm"] == "ddp" else r["swarmtrain_bytes_sent"]
        ratio = r["wire_bytes"] / counted if r["arm"] == "ddp" else r["wire_data_bytes"] / counted
        payload_ratio = "-" if r["arm"] == "ddp" else f"{r['wire_data_payload_bytes'] / counted:.3f}"
        print(f"{link_label(r):>20} {r['arm']:>24} {r['wall_s']:8.1f} {util:7.1f} {r['val_loss']:9.4f} "
              f"{_fmt_mb(r['wire_bytes'])} {_fmt_mb(r['wire_data_bytes'])} {_fmt_mb(r['wire_data_payload_bytes']):>10} "
              f"{_fmt_mb(counted):>10} {ratio:12.3f} {payload_ratio:>15} {r.get('heals', '-'):>5} {_peak(r):>14}")
    for r in results:
        if r["arm"] != "ddp":
            spread = r.get("send_spread_s_median")
            print(f"{link_label(r):>20} {r['arm']:>24}: utilization per peer {100 * min(r['utilization']):.1f}–"
                  f"{100 * max(r['utilization']):.1f}%, the peers' sends a median "
                  f"{'-' if spread is None else f'{1000 * spread:.0f} ms'} apart")
    for link in sorted({link_label(r) for r in results}):
        ddp = next((r for r in results if link_label(r) == link and r["arm"] == "ddp"), None)
        for r in results:
            if ddp is None or link_label(r) != link or r["arm"] == "ddp":
                continue
            tokens = f", tokens {r['tokens'] / ddp['tokens']:.3f}x DDP's" if "tokens" in r and "tokens" in ddp else ""
            print(f"{link} {r['arm']}: wall {r['wall_s'] / ddp['wall_s']:.3f}x DDP's{tokens}, "
                  f"val loss {100 * (r['val_loss'] / ddp['val_loss'] - 1):+.2f}% vs DDP, "
                  f"wire bytes {r['wire_bytes'] / ddp['wire_bytes']:.4f}x DDP's")
    for r in results:  # each arm with a round trip added against the same arm and rate without one
        base = next((b for b in results if b["rate"] == r["rate"] and b["arm"] == r["arm"] and not b.get("rtt_ms")),
                    None)
        if not r.get("rtt_ms") or base is None:
            continue
        util, base_util = (sum(x["utilization"]) / len(x["utilization"]) for x in (r, base))
        line = (f"{link_label(r)} {r['arm']}: wall {r['wall_s'] / base['wall_s']:.3f}x, compute utilization "
                f"{100 * util:.1f}% against {100 * base_util:.1f}% without the round trip")
        if "round_s_median" in r and "round_s_median" in base:
            line += (f", round {r['round_s_median']:.2f} s against {base['round_s_median']:.2f} s (outside compute "
                     f"{r['comm_s_median']:.2f} s against {base['comm_s_median']:.2f} s)")
        forwarder = r.get("delay_forwarder")
        if forwarder is not None:
            line += (f"; the delay forwarder used {forwarder['cpu_s']:.1f} CPU s for {forwarder['frames']} frames "
                     f"({forwarder['dropped']} dropped)")
        print(line)

def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {link_label(r): link_key(r) for r in results}
    rates = sorted(keys, key=keys.__getitem__)
    arms = sorted({r["arm"] for r in results}, key=arm_key)
    panels = [("wall-clock (s)", lambda r: r["wall_s"]),
              ("compute utilization (%)", lambda r: 100 * sum(r["utilization"]) / len(r["utilization"])),
              ("bytes on the wire (MB, kernel)", lambda r: r["wire_bytes"] / 1e6),
              ("final val loss", lambda r: r["val_loss"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    width = 0.8 / max(1, len(arms))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for j, arm in enumerate(arms):
            xs, ys = [], []
            for i, rate in enumerate(rates):
                r = next((x for x in results if link_label(x) == rate and x["arm"] == arm), None)
                if r is not None:
                    xs.append(i + j * width)
                    ys.append(value(r))
            ax.bar(xs, ys, width=width, label=arm)
        ax.set_xticks([i + width * (len(arms) - 1) / 2 for i in range(len(rates))], rates)
        ax.set_title(title, fontsize=10)
        if "MB" in title:
            ax.set_yscale("log")
        if "loss" in title:  # differences of a few percent must be visible
            losses = [value(r) for r in results]
            ax.set_ylim(min(losses) * 0.97, max(losses) * 1.02)
    axes[0].legend()
    fig.suptitle("4 namespace hosts, shaped links: DDP (gloo) vs swarmtrain DiLoCo", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def redraw(args: argparse.Namespace) -> int:
    out = Path(args.out)
    doc = json.loads(out.read_text())
    workload = Workload(**doc["workload"])
    for r in doc["results"]:
        events = out.parent / f"{out.stem}-runs" / run_dir_name(r["rate"], r.get("rtt_ms", 0.0), r["arm"]) / "logs" \
            / "events.jsonl"
        if r["arm"] != "ddp" and "heals" not in r:
            r.update(heal_accounting(events, workload))
        if r["arm"] != "ddp" and "send_spread_s_median" not in r and events.exists():
            r.update(send_spread(events))
    out.write_text(json.dumps(doc, indent=1))
    print_table(doc["results"])
    plot(doc["results"], out.with_suffix(".png"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return redraw(args)
    require_root()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every testbed is torn down
    arms = [a for a in args.arms.split(",") if a]
    for arm in arms:
        check_arm(arm)
    workload = Workload(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, rounds=args.rounds,
                        inner_steps=args.inner_steps, num_peers=args.hosts, warm_start_steps=args.warm_start_steps,
                        outer_lr=args.outer_lr, peer_data=args.peer_data)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work_dir = out.parent / f"{out.stem}-runs"
    if workload.warm_start_steps:
        workload = make_warm_start(workload, work_dir / f"warm-start-{workload.warm_start_steps}.safetensors")
    rates = args.rates.split(",")
    rtts = [float(x) for x in args.rtt_ms.split(",") if x]
    results: list[dict[str, Any]] = []
    if args.merge and out.exists():
        results = [r for r in json.loads(out.read_text())["results"]
                   if not (r["rate"] in rates and r.get("rtt_ms", 0.0) in rtts and r["arm"] in arms)]
    doc: dict[str, Any] = {"workload": workload.__dict__, "tokens_per_arm": workload.tokens,
                           "command": " ".join(sys.argv), "results": results,
                           "note": "2 cores for 4 hosts: 1 torch thread per process, compute oversubscribed"}
    for rate in rates:
        for rtt_ms in rtts:
            for arm in arms:
                t0 = time.perf_counter()
                label = link_label({"rate": rate, "rtt_ms": rtt_ms})
                print(f"[{time.strftime('%H:%M:%S')}] {label} {arm} ...", flush=True)
                result = {"rate": rate, "rtt_ms": rtt_ms,
                          **run_arm(arm, rate, workload, args, work_dir / run_dir_name(rate, rtt_ms, arm),
                                    rtt_ms=rtt_ms)}
                result["harness_s"] = time.perf_counter() - t0
                result["command"] = " ".join(sys.argv)  # --merge keeps other invocations' arms: each says how it ran
                results.append(result)
                out.write_text(json.dumps(doc, indent=1))  # after every arm: partial results survive
                print(f"  wall {result['wall_s']:.1f}s val {result['val_loss']:.4f}", flush=True)
    results.sort(key=lambda r: (*link_key(r), arm_key(r["arm"])))
    print_table(results)
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
