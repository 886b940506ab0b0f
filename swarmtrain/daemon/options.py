"""Shared CLI options: `--config run.toml` and repeated `--set section.key=value`."""

from __future__ import annotations

import argparse

from swarmtrain.config import RunConfig, load_config

__all__ = ["add_config_options", "add_insecure_option", "config_from_args", "exposure_error"]


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML", help="a TOML run config (defaults < file < --set)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field; repeatable")


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> RunConfig:
    """The resolved config; `extra` overrides (from dedicated flags) apply before --set ones."""
    return load_config(args.config, [*(extra or []), *args.overrides])


def add_insecure_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--insecure", action="store_true",
                        help="start even with an empty run key on an address other machines can reach (then anyone "
                             "who reaches the run can join it and steer it)")


def exposure_error(run_key: str, hosts: list[str], *, insecure: bool, tls: bool = False) -> str | None:
    """Why this process must not start (an open run on a reachable address without --insecure, or TLS
    without a run key), or None."""
    from swarmtrain.trust import InsecureRunError, RunSecret, check_exposure, resolve_run_key

    secret = RunSecret.from_run_key(resolve_run_key(run_key))
    if tls and secret.open:
        return "rpc.tls needs a run key (its certificates are derived from it): set SWARMTRAIN_RUN_KEY or rpc.run_key"
    try:
        check_exposure(secret, hosts, insecure=insecure)
    except InsecureRunError as e:
        return str(e)
    return None
