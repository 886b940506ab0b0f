"""`swarmtrain coordinator`: the run's first DHT node; publishes the run config and serves until a signal."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from swarmtrain.daemon.options import add_config_options, config_from_args

HELP = "start a run: the first DHT node, publishes the run config, prints READY {json} with its multiaddrs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address the DHT listens on (default 127.0.0.1; 0.0.0.0 on a public machine)")
    parser.add_argument("--port", type=int, help="DHT (libp2p) TCP port (default: any free port)")
    parser.add_argument("--announce-maddr", action="append", default=[], metavar="MULTIADDR",
                        help="multiaddr others should dial when it differs from the bound one; repeatable")
    parser.add_argument("--nat-port-map", action="store_true",
                        help="let the DHT ask the home router for a port mapping (UPnP/NAT-PMP)")
    add_config_options(parser)


def local_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as `discovery.key=value` overrides (they apply before --set ones)."""
    out: list[str] = []
    if args.host is not None:
        out.append(f"discovery.host={json.dumps(args.host)}")
    if args.port is not None:
        out.append(f"discovery.port={args.port}")
    if args.announce_maddr:
        out.append(f"discovery.announce_maddrs={json.dumps(args.announce_maddr)}")
    if args.nat_port_map:
        out.append("discovery.nat_port_map=true")
    return out


async def _serve(args: argparse.Namespace) -> int:
    from swarmtrain.discovery.coordinator import RunPublisher
    from swarmtrain.discovery.hivemind_dht import HivemindDiscovery
    from swarmtrain.telemetry.events import EventWriter

    cfg = config_from_args(args, extra=local_overrides(args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    discovery = await HivemindDiscovery.create(cfg.discovery, run_id=cfg.train.run_id)
    try:
        publisher = RunPublisher(discovery, cfg)
        await publisher.publish()
        EventWriter(sys.stdout).ready({
            "role": "coordinator", "peer_id": discovery.peer_id, "run_id": cfg.train.run_id,
            "maddrs": await discovery.visible_maddrs(),
        })
        await publisher.serve(stop)
    finally:
        await discovery.aclose()
    return 0


def run(args: argparse.Namespace) -> int:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(args))
