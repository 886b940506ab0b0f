"""`swarmtrain testbed up|run|status|down`: the network-namespace WAN twin from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "a WAN twin on this Linux machine: hosts as network namespaces on a shaped bridge (needs root)"

_NAME_HELP = "testbed name; its namespaces are NAME-sw and NAME-h0.. (default: swt)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    up = sub.add_parser("up", help="create N hosts on a bridge, each link shaped both ways")
    up.add_argument("--name", default="swt", help=_NAME_HELP)
    up.add_argument("--hosts", type=int, required=True, help="number of hosts (host I gets 10.77.0.(10+I))")
    up.add_argument("--rate", default="100mbit", help="each host's link rate, each direction (default: 100mbit)")
    up.add_argument("--delay-ms", type=float, default=0.0,
                    help="delay on each end of each link (host-to-host one way = 2x, round trip = 4x): netem's where "
                         "the kernel has it, else a forwarder process in the switch namespace (see --delay-by)")
    up.add_argument("--delay-by", choices=("auto", "netem", "forwarder"), default="auto",
                    help="what holds delayed frames: the kernel's netem qdisc, the user-space forwarder, or auto "
                         "(netem where the kernel has it; default)")
    up.add_argument("--loss-pct", type=float, default=0.0, help="netem loss on each end of each link; needs netem")
    up.add_argument("--mtu", type=int, default=1500, help="link MTU (default: 1500)")
    up.add_argument("--cpus", type=float, default=None,
                    help="cap each host at this many CPUs (a cgroup per host; e.g. 0.2): hosts compute like "
                         "separate machines instead of sharing every core (default: uncapped)")
    up.add_argument("--data-port", type=int, default=7000,
                    help="TCP port whose traffic is counted as data plane (bind peers' gRPC here; default: 7000)")

    run = sub.add_parser("run", help="run a command inside one host (`{ip}` in it becomes the host's address), "
                                     "or with --pipeline a whole pipeline swarm across the hosts")
    run.add_argument("--name", default="swt", help=_NAME_HELP)
    run.add_argument("--host", type=int, help="host index (required with a command)")
    run.add_argument("--pipeline", metavar="STAGES:SERVERS:TRAINERS",
                     help="instead of a command: a coordinator on host 0, SERVERS stage servers per stage and "
                          "TRAINERS trainers, one host each (e.g. 2:3:2; SERVERS may be one count per stage, "
                          "2:4,2:2); runs in the foreground until the trainers finish or Ctrl-C")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="with --pipeline: run config for the coordinator (repeatable)")
    run.add_argument("--data-port", type=int, default=7000,
                     help="with --pipeline: the testbed's data port (as given to `up`; default: 7000)")
    run.add_argument("--log-dir", help="with --pipeline: where each process's log goes (default: a new temp dir)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command and its arguments")

    status = sub.add_parser("status", help="print the testbed's hosts, link rate and kernel byte counters (JSON)")
    status.add_argument("--name", default="swt", help=_NAME_HELP)

    forward = sub.add_parser("forward", help="the user-space link delay of a testbed without netem (`up` starts it "
                                             "inside the switch namespace; not for use by hand)")
    forward.add_argument("--delay-ms", type=float, required=True, help="how long each frame is held, each way")
    forward.add_argument("--port", type=_port_pair, action="append", required=True, metavar="DEV:TAP",
                         help="a host's veth end and the TAP that stands for it on the bridge (repeatable)")
    forward.add_argument("--stats", help="write the counters here as JSON every second")

    down = sub.add_parser("down", help="kill everything inside the testbed and delete it (idempotent)")
    group = down.add_mutually_exclusive_group()
    group.add_argument("--name", default="swt", help=_NAME_HELP)
    group.add_argument("--all", action="store_true", help="every testbed found (namespaces named like NAME-sw/NAME-hI)")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.testbed import TestbedError

    try:
        return _ACTIONS[args.action](args)
    except TestbedError as e:
        print(f"swarmtrain testbed {args.action}: error: {e}", file=sys.stderr)
        return 2


def _port_pair(text: str) -> tuple[str, str]:
    dev, sep, tap = text.partition(":")
    if not sep or not dev or not tap:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DEV:TAP (e.g. h0:t0)")
    return dev, tap


def _forward(args: argparse.Namespace) -> int:
    """The delay forwarder (testbed/delay.py) in the foreground: READY once its ports are open, then until a
    signal; nothing more goes to stdout (whoever started it may have stopped reading)."""
    import signal

    from swarmtrain.testbed import TestbedError
    from swarmtrain.testbed.delay import Forwarder

    if not 0 <= args.delay_ms <= 10_000:
        raise TestbedError(f"--delay-ms {args.delay_ms:g}: must be in [0, 10000]")
    try:
        forwarder = Forwarder(args.port, delay_s=args.delay_ms / 1e3)
    except OSError as e:
        raise TestbedError(f"cannot open the forwarder's ports: {e}") from e
    signal.signal(signal.SIGTERM, lambda *_: forwarder.stop())
    signal.signal(signal.SIGINT, lambda *_: forwarder.stop())
    print("READY", flush=True)
    try:
        forwarder.run(stats_path=args.stats)
    finally:
        forwarder.close()
    return 0


def _up(args: argparse.Namespace) -> int:
    from swarmtrain.testbed import LinkSpec, Testbed, parse_rate

    link = LinkSpec(rate_bit_s=parse_rate(args.rate), delay_ms=args.delay_ms, loss_pct=args.loss_pct, mtu=args.mtu)
    testbed = Testbed(args.name, num_hosts=args.hosts, link=link, data_port=args.data_port, cpus=args.cpus,
                      delay_by=args.delay_by)
    testbed.up(persist=True)
    print(json.dumps(testbed.describe()), flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    from swarmtrain.testbed import TestbedError, find_testbeds, require_root
    from swarmtrain.testbed.netns import SUBNET_PREFIX, host_argv

    require_root()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.pipeline is not None:
        if cmd or args.host is not None:
            raise TestbedError("run: --pipeline starts its own processes on hosts 0.., give no --host and no command")
        return _run_pipeline(args)
    if args.overrides:
        raise TestbedError("run: --set goes with --pipeline (a command takes its own options)")
    if args.host is None:
        raise TestbedError("run: give --host I and the command after `--` (or --pipeline S:P:T)")
    if not cmd:
        raise TestbedError("run: give the command after `--`, e.g. swarmtrain testbed run --host 0 -- "
                           "swarmtrain coordinator")
    netns = f"{args.name}-h{args.host}"
    if netns not in find_testbeds().get(args.name, []):
        raise TestbedError(f"no host {args.host} in testbed {args.name!r} (namespace {netns} not found; "
                           f"is it up? `swarmtrain testbed up --name {args.name} --hosts N`)")
    ip = f"{SUBNET_PREFIX}{10 + args.host}"
    cmd = [part.replace("{ip}", ip) for part in cmd]
    os.environ.update(SWARMTRAIN_TESTBED_HOST=str(args.host), SWARMTRAIN_TESTBED_IP=ip)
    argv = host_argv(args.name, args.host, cmd)  # with the host's CPU cap, if `up --cpus` made one
    os.execvp(argv[0], argv)
    return 0  # not reached: execvp replaces this process


def _run_pipeline(args: argparse.Namespace) -> int:
    """A pipeline swarm on an up testbed: READY lines as one JSON line, then every process's lines as JSON
    (`proc` names the process) until the trainers leave or SIGINT/SIGTERM; then everything is stopped."""
    import signal
    import tempfile
    import threading
    from pathlib import Path

    from swarmtrain.telemetry.events import LeaveEvent
    from swarmtrain.testbed import LinkSpec, Testbed, TestbedError, find_testbeds
    from swarmtrain.testbed.counters import read_rate_bit_s
    from swarmtrain.testbed.pipeline import PipelineLayout, PipelineSwarm

    layout = PipelineLayout.parse(args.pipeline)
    hosts = [ns for ns in find_testbeds().get(args.name, []) if not ns.endswith("-sw")]
    if not hosts:
        raise TestbedError(f"no testbed {args.name!r} is up (`swarmtrain testbed up --name {args.name} "
                           f"--hosts {layout.num_hosts}`)")
    testbed = Testbed(args.name, num_hosts=len(hosts), link=LinkSpec(rate_bit_s=read_rate_bit_s(args.name, 0)),
                      data_port=args.data_port)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="swarmtrain-testbed-pipeline-"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with PipelineSwarm(testbed, layout, log_dir=log_dir, run_overrides=args.overrides) as swarm:
        ready = swarm.start(timeout_s=300.0)
        print(json.dumps({"pipeline": layout.describe(), "log_dir": str(log_dir), "ready": ready}), flush=True)
        shown = 0
        while not stop.wait(1.0):
            timeline = list(swarm.swarm.timeline)
            for _, name, line in timeline[shown:]:
                if hasattr(line, "event"):
                    print(json.dumps({"proc": name, "event": line.event, **_fields(line)}), flush=True)
            shown = len(timeline)
            left = {n for _, n, x in timeline if isinstance(x, LeaveEvent)}
            if set(swarm.trainers) <= left:
                break
    return 0


def _fields(line: object) -> dict[str, object]:
    import dataclasses

    return dataclasses.asdict(line) if dataclasses.is_dataclass(line) and not isinstance(line, type) else {}


def _status(args: argparse.Namespace) -> int:
    from swarmtrain.testbed import read_counters, require_root
    from swarmtrain.testbed.counters import read_rate_bit_s
    from swarmtrain.testbed.cpu import caps_of
    from swarmtrain.testbed.netns import SUBNET_PREFIX

    require_root()
    counters = read_counters(args.name)
    caps = {c.host: c for c in caps_of(args.name)}
    hosts = [{"index": i, "netns": f"{args.name}-h{i}", "ip": f"{SUBNET_PREFIX}{10 + i}",
              "rate_bit_s": read_rate_bit_s(args.name, i), "cpus": caps[i].cores() if i in caps else None,
              "counters": c.as_dict()} for i, c in counters.items()]
    print(json.dumps({"name": args.name, "hosts": hosts}, indent=2))
    return 0


def _down(args: argparse.Namespace) -> int:
    from swarmtrain.testbed import find_testbeds, require_root, teardown

    require_root()
    names = sorted(find_testbeds()) if args.all else [args.name]
    removed = [ns for name in names for ns in teardown(name)]
    print(json.dumps({"removed": removed}))
    return 0


_ACTIONS = {"up": _up, "run": _run, "status": _status, "forward": _forward, "down": _down}
