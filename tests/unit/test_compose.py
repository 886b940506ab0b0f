"""Static checks of deploy/ and docker/ against the real CLI parser (no Docker engine needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from swarmtrain.config import load_config
from swarmtrain.daemon.cli import COMMANDS, build_parser
from swarmtrain.testbed.shaping import bulk_port_of

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
ENV_EXAMPLE = REPO / "deploy" / ".env.example"
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cuda"]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
_VAR = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")
RUN_KEY = {"SWARMTRAIN_RUN_KEY": "test-run-key"}  # compose requires it; .env.example ships it empty


class MissingVariable(AssertionError):
    """Compose's `${VAR:?message}` with VAR unset or empty: `docker compose` refuses to start."""


def _env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` and `${VAR:?message}` substitution (the subset this file uses)."""
    def sub(m: re.Match[str]) -> str:
        name, kind, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if kind == "?":
            raise MissingVariable(f"{name}: {arg}")
        assert kind == "-", f"${{{name}}} has no default and no value in .env.example"
        return arg
    return _VAR.sub(sub, text)


def _compose(env: dict[str, str]) -> dict[str, Any]:
    return yaml.safe_load(_interpolate(COMPOSE.read_text(), env))


def _parse_cli(argv: list[str]) -> None:
    """Parse `swarmtrain ARGV` with the real parser; argparse's SystemExit becomes a test failure."""
    command = argv[0]
    if command not in COMMANDS:
        pytest.skip(f"`swarmtrain {command}` is not registered in swarmtrain.daemon.cli.COMMANDS yet")
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"swarmtrain rejects {argv}: exit {e.code}")


@pytest.mark.parametrize("env_source", ["defaults", "env_example"])
def test_compose_parses_and_has_the_topology(env_source: str) -> None:
    env = {**({} if env_source == "defaults" else _env_example()), **RUN_KEY}
    doc = _compose(env)
    services = doc["services"]
    assert set(services) == {"coordinator", "peer"}
    peer, coord = services["peer"], services["coordinator"]
    assert int(peer["deploy"]["replicas"]) == 3
    assert peer["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert "NET_ADMIN" in peer["cap_add"]
    assert {"SHAPE_RATE", "SHAPE_DELAY_MS", "SHAPE_LOSS_PCT"} <= set(peer["environment"])
    assert peer["environment"]["SHAPE_RATE"] == "100mbit"
    # Both on the private network; the rendezvous file that carries the coordinator's READY line is shared.
    for svc in services.values():
        assert svc["networks"] == ["swarm"]
    assert peer["environment"]["SWARMTRAIN_JOIN_FILE"] == coord["environment"]["SWARMTRAIN_READY_FILE"]
    assert peer["environment"]["SWARMTRAIN_RUN_KEY"] == coord["environment"]["SWARMTRAIN_RUN_KEY"] == "test-run-key"
    assert doc["networks"]["swarm"]["ipam"]["config"][0]["subnet"] == "10.78.0.0/24"


def test_compose_refuses_to_start_without_a_run_key() -> None:
    text = COMPOSE.read_text()
    uses = [m for m in _VAR.finditer(text) if m.group(1) == "SWARMTRAIN_RUN_KEY"]
    assert len(uses) == 2 and all(m.group(2) == "?" for m in uses), "both services take the key, with no default"
    for env in ({}, _env_example()):
        with pytest.raises(MissingVariable, match="SWARMTRAIN_RUN_KEY"):
            _interpolate(text, env)


def test_env_example_names_every_variable_compose_uses() -> None:
    used = {m.group(1) for m in _VAR.finditer(COMPOSE.read_text())}
    assert used == set(_env_example()), f"compose vars {sorted(used)} vs .env.example {sorted(_env_example())}"


@pytest.mark.parametrize("service", ["coordinator", "peer"])
def test_compose_commands_are_accepted_by_the_cli(service: str) -> None:
    command = [str(x) for x in _compose({**_env_example(), **RUN_KEY})["services"][service]["command"]]
    assert command[0] == service
    # The entrypoint replaces {ip}/{join} before exec; give the parser what it will see.
    resolved = [a.replace("{ip}", "10.78.0.5").replace("{join}", "/ip4/10.78.0.2/tcp/7001/p2p/QmX") for a in command]
    _parse_cli(resolved)


def _dockerfile_instr(path: Path, instr: str) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.startswith(f"{instr} ")]
    assert len(lines) == 1, f"{path.name}: expected exactly one {instr}"
    return json.loads(lines[0][len(instr) + 1:])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_and_cmd(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert _dockerfile_instr(dockerfile, "ENTRYPOINT") == ["swarmtrain-entrypoint"]
    assert "COPY docker/entrypoint.sh /usr/local/bin/swarmtrain-entrypoint" in text
    assert 'torch==${TORCH_VERSION}' in text and "ARG TORCH_VERSION=2.13.0" in text
    assert "iproute2" in text, "the entrypoint needs tc"
    cmd = _dockerfile_instr(dockerfile, "CMD")
    try:
        build_parser().parse_args(cmd)
    except SystemExit as e:
        assert e.code == 0, f"CMD {cmd} is rejected by the CLI"  # --help exits 0


def test_cpu_dockerfile_uses_the_cpu_wheel_on_slim_python() -> None:
    text = DOCKERFILES[0].read_text()
    assert text.splitlines()[2].startswith("FROM python:3.11-slim")
    assert "--index-url https://download.pytorch.org/whl/cpu" in text


def test_entrypoint_execs_swarmtrain_and_knows_the_compose_variables() -> None:
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert 'exec swarmtrain "${args[@]}"' in text
    compose_env = {k for svc in _compose(RUN_KEY)["services"].values() for k in svc["environment"]}
    for var in compose_env - {"SWARMTRAIN_RUN_KEY"}:  # the run key is read by swarmtrain itself
        assert var in text, f"compose sets {var} but the entrypoint never reads it"


def _resolved_command(svc: dict[str, Any]) -> list[str]:
    """A service's command as swarmtrain sees it, after the entrypoint replaced {ip} and {join}."""
    return [str(a).replace("{ip}", "10.78.0.5").replace("{join}", "/ip4/10.78.0.2/tcp/7001/p2p/QmX")
            for a in svc["command"]]


def _listening_ports(argv: list[str]) -> set[int]:
    """The TCP ports `swarmtrain ARGV` listens on, from the config its flags resolve to (0: any free port)."""
    args = build_parser().parse_args(argv)
    cfg = load_config(overrides=[*args._module.local_overrides(args), *args.overrides])
    if argv[0] == "coordinator":  # a DHT node, and its dashboard when asked for
        return {cfg.discovery.port} | ({args.dashboard_port} if args.dashboard_port is not None else set())
    assert argv[0] == "peer", argv
    bulk = {cfg.rpc.bulk_port} if cfg.rpc.bulk_transport == "tcp" and not cfg.discovery.client_mode else set()
    metrics = {args.metrics_port} if args.metrics_port is not None else set()
    return {cfg.rpc.port, cfg.discovery.port} | bulk | metrics


def _container_port(entry: str | int | dict[str, Any]) -> int:
    """The container side of a compose `ports:` entry ("8080", "HOST:8080", "IP:HOST:8080/tcp", long form)."""
    if isinstance(entry, dict):
        return int(entry["target"])
    return int(str(entry).rsplit(":", 1)[-1].split("/")[0])


def test_container_port_reads_every_ports_syntax() -> None:
    for entry in (8080, "8080", "9000:8080", "127.0.0.1:9000:8080/tcp", {"target": 8080, "published": 9000}):
        assert _container_port(entry) == 8080


def test_every_published_or_exposed_port_is_one_a_process_listens_on() -> None:
    services = _compose({**_env_example(), **RUN_KEY})["services"]
    listening = {name: _listening_ports(_resolved_command(svc)) for name, svc in services.items()}
    assert listening == {"coordinator": {7001, 8080}, "peer": {7000, 7001, 7010, 9100}}
    for name, svc in services.items():
        published = {_container_port(p) for p in svc.get("ports", [])} | {int(p) for p in svc.get("expose", [])}
        assert published <= listening[name], (
            f"{name} publishes {sorted(published - listening[name])}: nothing serves it")
    every = set().union(*listening.values())
    assert 0 not in every, "a port chosen at random could not be published or opened in a firewall"
    for dockerfile in DOCKERFILES:
        exposed = {int(p.split("/")[0]) for line in dockerfile.read_text().splitlines()
                   if line.startswith("EXPOSE ") for p in line.split()[1:]}
        assert exposed == every, f"{dockerfile.name} exposes {sorted(exposed)}, the processes listen on {sorted(every)}"


def test_the_peer_bulk_port_is_the_testbed_twins() -> None:
    peer = _compose({**_env_example(), **RUN_KEY})["services"]["peer"]
    args = build_parser().parse_args(_resolved_command(peer))
    cfg = load_config(overrides=[*args._module.local_overrides(args), *args.overrides])
    assert cfg.rpc.bulk_port == bulk_port_of(cfg.rpc.port)
