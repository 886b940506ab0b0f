"""`swarmtrain peer --join MULTIADDR`: the peer daemon (a DiLoCo worker of a running swarm)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmtrain.daemon.options import add_config_options, add_insecure_option

if TYPE_CHECKING:
    from swarmtrain.roles.worker import Peer

HELP = ("join a run as a DiLoCo peer (or a pipeline stage server or trainer): prints READY {json}, then one JSON "
        "line per round (per step)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--join", action="append", required=True, metavar="MULTIADDR",
                        help="multiaddr of a swarm member (the coordinator's READY line has them); repeatable")
    parser.add_argument("--host", help="address the gRPC server and the DHT listen on (default 127.0.0.1; "
                                       "0.0.0.0 on a public machine)")
    parser.add_argument("--port", type=int, help="gRPC port (default: any free port)")
    parser.add_argument("--dht-port", type=int, help="DHT (libp2p) port (default: any free port)")
    parser.add_argument("--announce", metavar="HOST:PORT",
                        help="the gRPC address other peers dial, when it differs from the bound one (NAT, docker)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="save state here every round and on exit; resume from it on restart")
    parser.add_argument("--client-mode", action="store_true",
                        help="behind NAT: only dial out; contribute and receive but never reduce")
    parser.add_argument("--nat-port-map", action="store_true",
                        help="let the DHT ask the home router for a port mapping (UPnP/NAT-PMP)")
    parser.add_argument("--shard-index", type=int, metavar="K",
                        help="in a run with data.num_shards > 0: the slot of the data stream this peer reads "
                             "(default: its checkpoint's slot, else the lowest slot no live peer reads)")
    parser.add_argument("--coordinator-id", help="the coordinator's peer id, if several publish this run")
    parser.add_argument("--role", choices=("worker", "server", "trainer"), default="worker",
                        help="worker: a DiLoCo peer holding the whole model (default); in a run with "
                             "pipeline.stages > 0, server: serve one stage's blocks, trainer: hold the data, "
                             "embeddings and head and drive micro-batches through the stages")
    parser.add_argument("--stage", type=int, metavar="K",
                        help="with --role server: the stage to serve (default: the one with the fewest servers "
                             "per block)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve this peer's Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
                             "the READY line's \"metrics\" says which); off by default")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics endpoint listens on (default 127.0.0.1)")
    parser.add_argument("--export-dir", metavar="OUT",
                        help="when the peer leaves, write the swarm's θ_global there as a Hugging Face directory "
                             "(config.json, model.safetensors, tokenizer; see `swarmtrain export`)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="human-readable progress on stderr: a status line per second, a line per round, "
                             "heal and leave (default: on when stderr is a terminal); stdout is unchanged")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="train on N local ranks as one peer (an island: DDP over N GPUs, or N CPU "
                             "processes with gloo); rank 0 talks to the swarm. Under torchrun, leave it out: "
                             "each process is one rank already")
    add_insecure_option(parser)
    add_config_options(parser)


def local_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as `section.key=value` overrides of this peer's local sections."""
    out = [f"discovery.initial_peers={_toml_list(args.join)}"]
    if args.host is not None:
        out += [f"rpc.host={_toml_str(args.host)}", f"discovery.host={_toml_str(args.host)}"]
    if args.port is not None:
        out.append(f"rpc.port={args.port}")
    if args.dht_port is not None:
        out.append(f"discovery.port={args.dht_port}")
    if args.announce is not None:
        out.append(f"rpc.announce={_toml_str(args.announce)}")
        host = args.announce.rpartition(":")[0].strip("[]")
        if args.dht_port:
            proto = "ip6" if ":" in host else "ip4"
            out.append(f"discovery.announce_maddrs={_toml_list([f'/{proto}/{host}/tcp/{args.dht_port}'])}")
    if args.checkpoint_dir is not None:
        out.append(f"checkpoint.dir={_toml_str(args.checkpoint_dir)}")
    if args.client_mode:
        out.append("discovery.client_mode=true")
    if args.nat_port_map:
        out.append("discovery.nat_port_map=true")
    if args.shard_index is not None:
        out.append(f"data.shard_index={args.shard_index}")
    return out


def progress_enabled(args: argparse.Namespace, *, stderr_is_tty: bool) -> bool:
    """--progress / --no-progress, else on exactly when stderr is a terminal."""
    return stderr_is_tty if args.progress is None else bool(args.progress)


def _metrics(args: argparse.Namespace) -> tuple[str, int] | None:
    """(host, port) of the metrics endpoint, or None without --metrics-port."""
    return None if args.metrics_port is None else (args.metrics_host, args.metrics_port)


def _without_nproc(argv: list[str]) -> list[str]:
    """`argv` less its --nproc-per-node option (the ranks it starts must not start more)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(_toml_str(x) for x in items) + "]"


def run(args: argparse.Namespace) -> int:
    import contextlib
    import sys

    from swarmtrain.daemon.options import config_from_args, exposure_error
    from swarmtrain.diloco.island import IslandLost, island_env
    from swarmtrain.peer import PeerError
    from swarmtrain.roles.process import run_peer_process
    from swarmtrain.telemetry.console import ConsoleProgress

    local = config_from_args(args, extra=local_overrides(args))
    refused = exposure_error(local.rpc.run_key, [local.rpc.host, local.discovery.host], insecure=args.insecure,
                             tls=local.rpc.tls)
    if refused:
        print(f"swarmtrain peer: error: {refused}", file=sys.stderr)
        return 2
    if args.stage is not None and args.role != "server":
        print("swarmtrain peer: error: --stage goes with --role server", file=sys.stderr)
        return 2
    nproc = args.nproc_per_node
    if nproc is not None and nproc < 1:
        print(f"swarmtrain peer: error: --nproc-per-node must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    if ((nproc or 1) > 1 or island_env() is not None) and args.role != "worker":
        print("swarmtrain peer: error: an island (--nproc-per-node, torchrun) trains a DiLoCo worker; "
              f"--role {args.role} runs on one process", file=sys.stderr)
        return 2
    if (nproc or 1) > 1:
        from swarmtrain.peer.island import launch_island

        return launch_island(_without_nproc(args._argv), nproc=nproc)
    if args.role != "worker":
        from swarmtrain.roles.process import run_pipeline_process

        try:
            return run_pipeline_process(local, role=args.role, stage=args.stage, local_overrides=args.overrides,
                                        coordinator_id=args.coordinator_id, metrics=_metrics(args))
        except PeerError as e:
            print(f"swarmtrain peer: error: {e}", file=sys.stderr)
            return 1
    progress = None
    if progress_enabled(args, stderr_is_tty=sys.stderr.isatty()):
        progress = ConsoleProgress(sys.stderr, in_place=sys.stderr.isatty())
    try:
        with progress.active() if progress is not None else contextlib.nullcontext():
            return run_peer_process(local, local_overrides=args.overrides, coordinator_id=args.coordinator_id,
                                    progress=progress, metrics=_metrics(args), after_leave=_exporter(args))
    except (PeerError, IslandLost) as e:  # IslandLost: a rank of this peer's island died or hung
        print(f"swarmtrain peer: error: {e}", file=sys.stderr)
        return 1


def _exporter(args: argparse.Namespace) -> Callable[[Peer], None] | None:
    """`--export-dir OUT`: the θ_global the peer leaves with, written to OUT once it has left."""
    if not args.export_dir:
        return None
    from swarmtrain.daemon.cmd_export import export_on_leave

    return lambda peer: export_on_leave(peer, args.export_dir)
