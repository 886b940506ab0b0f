"""Shared CLI options: `--config run.toml` and repeated `--set section.key=value`."""

from __future__ import annotations

import argparse

from swarmtrain.config import RunConfig, load_config

__all__ = ["add_config_options", "config_from_args"]


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML", help="a TOML run config (defaults < file < --set)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field; repeatable")


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> RunConfig:
    """The resolved config; `extra` overrides (from dedicated flags) apply before --set ones."""
    return load_config(args.config, [*(extra or []), *args.overrides])
