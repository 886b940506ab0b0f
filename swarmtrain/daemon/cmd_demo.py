"""`swarmtrain demo`: a coordinator and N peers as subprocesses on 127.0.0.1, a live view, a summary."""

from __future__ import annotations

import argparse
import queue
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from swarmtrain.daemon.options import add_config_options, config_from_args
from swarmtrain.process.children import Child, ChildExitedError, start_coordinator, stop_all, swarmtrain_argv
from swarmtrain.telemetry.events import Line
from swarmtrain.telemetry.progress import RoundSummary, SwarmProgress, format_bytes, format_round

HELP = "run a whole swarm on this machine (coordinator + N peers on 127.0.0.1) with a live progress view"

# The default tiny run: a ~0.1M-parameter model on 2 MB of the stdlib corpus, int8 pseudo-gradients,
# short timeouts for loopback.
DEMO_OVERRIDES: tuple[str, ...] = (
    "model.preset=tiny",
    "data.max_corpus_bytes=2000000",
    "data.seq_len=64",
    "data.batch_size=8",
    "inner.warmup_steps=5",
    "diloco.inner_steps=25",
    "diloco.eval_batches=4",
    "averaging.matchmaking_timeout_s=3.0",
    "averaging.allreduce_timeout_s=15.0",
    "averaging.contribution_window_s=3.0",
    "discovery.heartbeat_s=1.0",
    "discovery.record_ttl_s=6.0",
    "rpc.call_timeout_s=5.0",
    "train.threads=1",
    "compress.codec=int8",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=_positive_int, default=3, help="number of peers (default: 3)")
    parser.add_argument("--rounds", type=_positive_int, default=8, help="outer rounds to train (default: 8)")
    parser.add_argument("--log-dir", help="where the children's logs go (default: a new temporary directory)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up after this long (default: 600)")
    parser.add_argument("--start-timeout-s", type=float, default=120.0,
                        help="how long each process may take to print READY (default: 120)")
    parser.add_argument("--hold", action="store_true",
                        help="after the last round keep the coordinator and its dashboard up until Ctrl-C / SIGTERM")
    parser.add_argument("--pipeline", action="store_true",
                        help="a SWARM pipeline instead: 2 stages × 2 stage servers and 2 trainers, one server "
                             "killed half-way (--rounds × diloco.inner_steps steps per trainer)")
    add_config_options(parser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class DemoOutcome:
    rounds_committed: int
    rounds_disagreeing: int
    first_val_loss: float | None
    last_val_loss: float | None
    bytes_sent: int
    peers_failed: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.rounds_committed > 0 and self.rounds_disagreeing == 0 and not self.peers_failed


def run(args: argparse.Namespace) -> int:
    if args.pipeline:
        from swarmtrain.daemon.demo_pipeline import PIPELINE_OVERRIDES, run_pipeline_demo

        overrides = [*PIPELINE_OVERRIDES, f"diloco.rounds={args.rounds}", *args.overrides]
        cfg = config_from_args(argparse.Namespace(config=args.config, overrides=overrides))
        previous = _raise_on_sigterm()
        try:
            return run_pipeline_demo(cfg, overrides, ["--config", args.config] if args.config else [],
                                     log_dir=args.log_dir, start_timeout_s=args.start_timeout_s,
                                     timeout_s=args.timeout_s, hold=_hold if args.hold else None)
        except KeyboardInterrupt:
            _say("interrupted: stopping all processes")
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
    # The demo knows its peers, so they read disjoint slots of the data (--set data.num_shards=0: each
    # its own permutation, as in an open swarm).
    overrides = [*DEMO_OVERRIDES, f"diloco.rounds={args.rounds}", f"data.num_shards={args.peers}",
                 f"averaging.min_peers={min(2, args.peers)}", *args.overrides]
    config_args = ["--config", args.config] if args.config else []
    cfg = config_from_args(argparse.Namespace(config=args.config, overrides=overrides))  # fail fast on bad --set
    if cfg.data.num_shards not in (0, args.peers):
        _say(f"demo: data.num_shards={cfg.data.num_shards} must be 0 or --peers ({args.peers})")
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="swarmtrain-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    lines: queue.Queue[tuple[str, Line]] = queue.Queue()
    children: list[Child] = []
    previous = _raise_on_sigterm()
    started = time.monotonic()
    try:
        _say(f"swarmtrain demo: coordinator + {args.peers} peers on 127.0.0.1, {args.rounds} rounds of "
             f"{cfg.diloco.inner_steps} inner steps, model {cfg.model.preset}, codec {cfg.compress.codec}; "
             f"logs in {log_dir}")
        join, dashboard = start_coordinator(overrides, config_args, log_dir=log_dir, timeout_s=args.start_timeout_s,
                                            children=children, dashboard=True)
        _say(f"coordinator ready at {join}")
        _say(f"dashboard: {dashboard} (open it in a browser; --hold keeps it up after the last round)")
        peers = [Child(f"peer{i}", swarmtrain_argv("peer", "--join", join,
                                                   *(["--shard-index", str(i)] if cfg.data.num_shards else [])),
                       log_path=log_dir / f"peer{i}.log", on_line=lambda name, line: lines.put((name, line)))
                 for i in range(args.peers)]
        children.extend(peers)
        for p in peers:
            info = p.wait_ready(timeout_s=args.start_timeout_s)
            _say(f"{p.name} ready: id {str(info.get('peer_id', '?'))[:16]}, grpc {info.get('endpoint', '?')}")
        outcome = _follow(peers, lines, started=started, timeout_s=args.timeout_s)
        _print_summary(outcome, started=started, log_dir=log_dir)
        if args.hold:
            _hold(dashboard)
        return 0 if outcome.ok else 1
    except (DemoError, ChildExitedError, TimeoutError) as e:
        _say(f"demo failed: {e}")
        return 1
    except KeyboardInterrupt:
        _say("interrupted: stopping all processes")
        return 130
    finally:
        stop_all(children)
        signal.signal(signal.SIGTERM, previous)


def _hold(dashboard: str) -> None:
    """Keep the coordinator (and its dashboard) up until interrupted (KeyboardInterrupt: also on SIGTERM)."""
    _say(f"holding: the dashboard stays at {dashboard}; Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _say("stopping")


class DemoError(ValueError):
    """The demo's arguments are wrong or a child misbehaved in a way the demo cannot recover from."""


def _follow(peers: list[Child], lines: queue.Queue[tuple[str, Line]], *, started: float,
            timeout_s: float) -> DemoOutcome:
    """Print one line per completed round until every peer left; return what happened."""
    progress = SwarmProgress([p.name for p in peers])
    deadline = started + timeout_s
    summaries: list[RoundSummary] = []
    failed: list[str] = []
    while not progress.done:
        if time.monotonic() > deadline:
            raise DemoError(f"the demo did not finish within {timeout_s:.0f}s (see the logs)")
        try:
            name, line = lines.get(timeout=0.5)
        except queue.Empty:
            for p in peers:
                if not p.alive and p.name not in progress.left:
                    failed.append(p.name)
                    _say(f"{p.name} exited with code {p.proc.returncode}; {p.diagnostics(tail_lines=5)}")
                    summaries += _show(progress.peer_exited(p.name), len(peers), started)
            continue
        summaries += _show(progress.add(name, line), len(peers), started)
    summaries += _show(progress.finish(), len(peers), started)
    for p in peers:
        rc = p.proc.wait(timeout=30.0)
        if rc != 0 and p.name not in failed:
            failed.append(p.name)
    committed = [s for s in summaries if s.committed]
    vals = [s.val_loss for s in committed if s.val_loss is not None]
    return DemoOutcome(
        rounds_committed=len(committed),
        rounds_disagreeing=sum(1 for s in committed if not s.agree),
        first_val_loss=vals[0] if vals else None,
        last_val_loss=vals[-1] if vals else None,
        bytes_sent=sum(s.bytes_sent for s in summaries),
        peers_failed=tuple(failed),
    )


def _show(summaries: list[RoundSummary], num_peers: int, started: float) -> list[RoundSummary]:
    for s in summaries:
        _say(format_round(s, num_peers=num_peers, elapsed_s=time.monotonic() - started))
    return summaries


def _print_summary(o: DemoOutcome, *, started: float, log_dir: Path) -> None:
    val = (f"{o.first_val_loss:.3f} -> {o.last_val_loss:.3f}"
           if o.first_val_loss is not None and o.last_val_loss is not None else "n/a")
    _say("summary:")
    _say(f"  rounds committed: {o.rounds_committed}; rounds where hashes differed: {o.rounds_disagreeing}")
    _say(f"  val loss: {val}; bytes sent (all peers): {format_bytes(o.bytes_sent)}")
    _say(f"  peers failed: {', '.join(o.peers_failed) or 'none'}; wall time {time.monotonic() - started:.1f}s")
    _say(f"  result: {'OK' if o.ok else 'FAILED'} (logs in {log_dir})")


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _raise_on_sigterm() -> Any:
    """SIGTERM takes the same path as Ctrl-C, so the children are always stopped."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)
