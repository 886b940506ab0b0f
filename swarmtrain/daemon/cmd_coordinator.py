"""`swarmtrain coordinator`: the run's first DHT node; publishes the run config and serves until a signal.

SIGTERM or SIGINT: it stops publishing and closes its DHT node (killed if it does not answer) within
`discovery.shutdown_timeout_s` + SHUTDOWN_MARGIN_S, then exits 0; a shutdown that outlives that bound is
cut short with status 1, and a second signal exits at once with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from swarmtrain.config import DiscoveryConfig, RunConfig
from swarmtrain.daemon.options import (
    add_config_options,
    add_insecure_option,
    config_from_args,
    exposure_error,
)
from swarmtrain.process.signals import OVERRUN_STATUS, StopSignals

if TYPE_CHECKING:
    from swarmtrain.dashboard import Dashboard
    from swarmtrain.discovery import Discovery

HELP = "start a run: the first DHT node, publishes the run config, prints READY {json} with its multiaddrs"
# Past discovery.shutdown_timeout_s: the DHT's forced stop (at most 3 s) and this process's own exit.
SHUTDOWN_MARGIN_S = 5.0
CANCEL_WAIT_S = 1.0  # a cancelled refresh only has to unwind its awaits
EPILOG = (f"SIGTERM or SIGINT stops it within discovery.shutdown_timeout_s + {SHUTDOWN_MARGIN_S:.0f} s "
          f"({DiscoveryConfig().shutdown_timeout_s + SHUTDOWN_MARGIN_S:.0f} s by default; a DHT process that "
          f"does not answer is killed) with status 0; a shutdown past that bound is cut short with status "
          f"{OVERRUN_STATUS}; a second signal exits at once with status 128 + its number.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address the DHT listens on (default 127.0.0.1; 0.0.0.0 on a public machine)")
    parser.add_argument("--port", type=int, help="DHT (libp2p) TCP port (default: any free port)")
    parser.add_argument("--announce-maddr", action="append", default=[], metavar="MULTIADDR",
                        help="multiaddr others should dial when it differs from the bound one; repeatable")
    parser.add_argument("--nat-port-map", action="store_true",
                        help="let the DHT ask the home router for a port mapping (UPnP/NAT-PMP)")
    parser.add_argument("--dashboard-port", type=int, metavar="PORT",
                        help="serve the dashboard (page, JSON API, /metrics) on this port (0: any free port; the "
                             "READY line's \"dashboard\" says which); off by default")
    parser.add_argument("--dashboard-host", default="127.0.0.1",
                        help="address the dashboard listens on (default 127.0.0.1; it is read-only)")
    add_insecure_option(parser)
    add_config_options(parser)
    parser.epilog = EPILOG


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
    from swarmtrain.discovery.coordinator import RunPublisher, with_run_nonce
    from swarmtrain.discovery.hivemind_dht import HivemindDiscovery
    from swarmtrain.models.spec import resolve_run
    from swarmtrain.telemetry.events import EventWriter
    from swarmtrain.trust import resolve_run_key

    # The model, tokenizer and shards checked against each other once, here, and their resolved form
    # published: peers compare theirs with it.
    cfg = resolve_run(config_from_args(args, extra=local_overrides(args)))
    refused = exposure_error(cfg.rpc.run_key, [cfg.discovery.host], insecure=args.insecure, tls=cfg.rpc.tls)
    if refused:
        print(f"swarmtrain coordinator: error: {refused}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    dashboard: Dashboard | None = None
    # Never uninstalled: a second signal must work until the process is gone (interpreter exit included).
    StopSignals(leaving="stopping the coordinator",
                deadline_s=cfg.discovery.shutdown_timeout_s + SHUTDOWN_MARGIN_S).install(stop)
    discovery = await HivemindDiscovery.create(cfg.discovery, run_id=cfg.train.run_id,
                                               run_key=resolve_run_key(cfg.rpc.run_key))
    try:
        cfg = await with_run_nonce(discovery, cfg, timeout_s=cfg.rpc.call_timeout_s)
        publisher = RunPublisher(discovery, cfg)
        await publisher.publish()
        if args.dashboard_port is not None:
            dashboard = await _open_dashboard(discovery, cfg, host=args.dashboard_host, port=args.dashboard_port)
        EventWriter(sys.stdout).ready({
            "role": "coordinator", "peer_id": discovery.peer_id, "run_id": cfg.train.run_id,
            "run_nonce": cfg.train.run_nonce,
            "maddrs": await discovery.visible_maddrs(),
            **({"dashboard": f"http://{args.dashboard_host}:{dashboard.port}/"} if dashboard is not None else {}),
        })
        await _until(stop, publisher.serve(stop))
    finally:
        if dashboard is not None:
            await dashboard.close()
        await discovery.aclose()
    return 0


async def _open_dashboard(discovery: Discovery, cfg: RunConfig, *, host: str, port: int) -> Dashboard:
    """The coordinator's dashboard, listening (its history in `dashboard.db`, or a file named after the run)."""
    from swarmtrain.dashboard import Collector, Dashboard, History

    d = cfg.dashboard
    history = History(d.db or f"swarmtrain-{cfg.train.run_id}.dashboard.sqlite", retention_rounds=d.retention_rounds)
    collector = Collector(discovery, history, d, record_ttl_s=cfg.discovery.record_ttl_s,
                          io_timeout_s=cfg.rpc.call_timeout_s)
    dashboard = Dashboard(collector, host=host, port=port, poll_s=d.poll_s or cfg.discovery.heartbeat_s)
    await dashboard.start()
    return dashboard


async def _until(stop: asyncio.Event, work: Awaitable[None]) -> None:
    """Run `work` until it returns or `stop` is set, then cancel it: an in-flight run record refresh (DHT
    calls with deadlines of several heartbeats) must not delay the leave."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, stopping):
            task.cancel()
        await asyncio.wait({working, stopping}, timeout=CANCEL_WAIT_S)
    if working.done() and not working.cancelled():
        working.result()  # its exception, if it failed


def run(args: argparse.Namespace) -> int:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(args))
