"""`swarmtrain config show`: print the resolved run config as TOML."""

from __future__ import annotations

import argparse
import sys

from swarmtrain.config import to_toml
from swarmtrain.daemon.options import add_config_options, config_from_args

HELP = "show the resolved run config (defaults < --config file < --set overrides)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show"], help="what to do with the config")
    add_config_options(parser)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(to_toml(config_from_args(args)))
    return 0
