"""No Docker engine here: check deploy/ and docker/ statically against the real CLI parser."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from swarmtrain.daemon.cli import COMMANDS, build_parser

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
ENV_EXAMPLE = REPO / "deploy" / ".env.example"
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cuda"]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` substitution (the subset this file uses)."""
    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if env.get(name):
            return env[name]
        assert default is not None, f"${{{name}}} has no default and no value in .env.example"
        return default
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
    env = {} if env_source == "defaults" else _env_example()
    doc = _compose(env)
    services = doc["services"]
    assert set(services) == {"coordinator", "peer"}
    peer, coord = services["peer"], services["coordinator"]
    assert int(peer["deploy"]["replicas"]) == 3
    assert peer["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert "NET_ADMIN" in peer["cap_add"]
    assert {"SHAPE_RATE", "SHAPE_DELAY_MS", "SHAPE_LOSS_PCT"} <= set(peer["environment"])
    assert peer["environment"]["SHAPE_RATE"] == "100mbit"
    assert any(str(p).endswith(":8080") for p in coord["ports"]), "the dashboard port is published"
    # Both on the private network; the rendezvous file that carries the coordinator's READY line is shared.
    for svc in services.values():
        assert svc["networks"] == ["swarm"]
    assert peer["environment"]["SWARMTRAIN_JOIN_FILE"] == coord["environment"]["SWARMTRAIN_READY_FILE"]
    assert doc["networks"]["swarm"]["ipam"]["config"][0]["subnet"] == "10.78.0.0/24"


def test_env_example_names_every_variable_compose_uses() -> None:
    used = {m.group(1) for m in _VAR.finditer(COMPOSE.read_text())}
    assert used == set(_env_example()), f"compose vars {sorted(used)} vs .env.example {sorted(_env_example())}"


@pytest.mark.parametrize("service", ["coordinator", "peer"])
def test_compose_commands_are_accepted_by_the_cli(service: str) -> None:
    command = [str(x) for x in _compose(_env_example())["services"][service]["command"]]
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
    compose_env = {k for svc in _compose({})["services"].values() for k in svc["environment"]}
    for var in compose_env - {"SWARMTRAIN_RUN_KEY"}:  # the run key is read by swarmtrain itself
        assert var in text, f"compose sets {var} but the entrypoint never reads it"
