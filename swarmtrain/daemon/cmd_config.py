"""`swarmtrain config show|reference`: the resolved run config as TOML, or the reference of every field."""

from __future__ import annotations

import argparse
import sys

from swarmtrain.config import ConfigError, to_toml
from swarmtrain.daemon.options import add_config_options, config_from_args

HELP = ("show the resolved run config (defaults < --config file < --set overrides), "
        "or print the reference of every field as Markdown")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show", "reference"],
                        help="show: the resolved config as TOML; reference: every field's type, default and meaning")
    add_config_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.action == "reference":
        if args.config or args.overrides:
            raise ConfigError("reference documents the defaults; it takes no --config or --set")
        from swarmtrain.daemon.config_reference import render_reference

        sys.stdout.write(render_reference())
        return 0
    sys.stdout.write(to_toml(config_from_args(args)))
    return 0
