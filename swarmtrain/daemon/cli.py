"""The `swarmtrain` command: one subcommand per module, heavy imports deferred to `run()`."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import io
import logging
import os
import signal
import sys
from collections.abc import Sequence

from swarmtrain.config import ConfigError

__all__ = ["LOG_LEVEL_ENV", "main"]

LOG_LEVEL_ENV = "SWARMTRAIN_LOG_LEVEL"

# subcommand -> module exposing HELP, add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, str] = {
    "config": "swarmtrain.daemon.cmd_config",
    "coordinator": "swarmtrain.daemon.cmd_coordinator",
    "data": "swarmtrain.daemon.cmd_data",
    "demo": "swarmtrain.daemon.cmd_demo",
    "export": "swarmtrain.daemon.cmd_export",
    "generate": "swarmtrain.daemon.cmd_generate",
    "peer": "swarmtrain.daemon.cmd_peer",
    "simulate": "swarmtrain.daemon.cmd_simulate",
    "testbed": "swarmtrain.daemon.cmd_testbed",
    "tokenizer": "swarmtrain.daemon.cmd_tokenizer",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmtrain", description="Decentralized DiLoCo training over the internet.")
    parser.add_argument("--log-level", default=os.environ.get(LOG_LEVEL_ENV, "WARNING"),
                        help=f"logging level for the library (default: ${LOG_LEVEL_ENV}, else WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # what a command that restarts itself passes on
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 PID` prints every thread's stack to stderr: what a hung daemon is waiting on. (Not when
    # stderr is no file, as when main() runs inside a test that captures it.)
    with contextlib.suppress(io.UnsupportedOperation, ValueError):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)
    try:
        return int(args._module.run(args) or 0)
    except (ValueError, OSError) as e:
        # Every user-facing error of the library (ConfigError, CorpusError, CheckpointError, ...) is a
        # ValueError subclass whose message names what was wrong: one line, traceback only on request.
        logging.getLogger(__name__).debug("%s failed", args.command, exc_info=True)
        kind = "" if isinstance(e, ConfigError) else f"{type(e).__name__}: "
        print(f"swarmtrain {args.command}: error: {kind}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
