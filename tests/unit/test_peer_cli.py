"""CLI surfaces of `swarmtrain peer` and `swarmtrain demo`: flags map onto config fields, bad values are refused."""

from __future__ import annotations

import sys

import pytest

from swarmtrain.config import load_config
from swarmtrain.daemon.cli import build_parser
from swarmtrain.daemon.cmd_peer import local_overrides, progress_enabled

pytestmark = pytest.mark.unit


def test_peer_flags_become_local_config_overrides() -> None:
    args = build_parser().parse_args([
        "peer", "--join", "/ip4/1.2.3.4/tcp/1/p2p/QmX", "--join", "/ip4/5.6.7.8/tcp/2/p2p/QmY",
        "--host", "0.0.0.0", "--port", "5000", "--dht-port", "6000", "--announce", "203.0.113.7:5000",
        "--checkpoint-dir", "/tmp/ck", "--client-mode", "--shard-index", "2", "--set", "train.threads=2",
    ])
    cfg = load_config(overrides=[*local_overrides(args), *args.overrides])
    assert cfg.discovery.initial_peers == ("/ip4/1.2.3.4/tcp/1/p2p/QmX", "/ip4/5.6.7.8/tcp/2/p2p/QmY")
    assert (cfg.rpc.host, cfg.rpc.port, cfg.rpc.announce) == ("0.0.0.0", 5000, "203.0.113.7:5000")
    assert (cfg.discovery.host, cfg.discovery.port) == ("0.0.0.0", 6000)
    assert cfg.discovery.announce_maddrs == ("/ip4/203.0.113.7/tcp/6000",)
    assert cfg.checkpoint.dir == "/tmp/ck" and cfg.discovery.client_mode and not cfg.discovery.nat_port_map
    assert cfg.train.threads == 2 and cfg.data.shard_index == 2


def test_peer_needs_join_and_defaults_stay_loopback() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer"])
    args = build_parser().parse_args(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX"])
    cfg = load_config(overrides=local_overrides(args))
    assert (cfg.rpc.host, cfg.rpc.port, cfg.discovery.host) == ("127.0.0.1", 0, "127.0.0.1")
    assert not cfg.discovery.client_mode and cfg.checkpoint.dir == ""


@pytest.mark.parametrize("flag", ["--peers", "--rounds"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_demo_refuses_non_positive_counts(flag: str, value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", flag, value])


def test_demo_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert (args.peers, args.rounds, args.overrides) == (3, 8, [])


def test_demo_refuses_shards_that_do_not_match_its_peers(capsys: pytest.CaptureFixture[str]) -> None:
    from swarmtrain.daemon import cmd_demo

    args = build_parser().parse_args(["demo", "--peers", "3", "--set", "data.num_shards=5"])
    assert cmd_demo.run(args) == 2
    assert "data.num_shards=5 must be 0 or --peers (3)" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "tty", "enabled"), [
    ([], True, True), ([], False, False), (["--no-progress"], True, False), (["--progress"], False, True)])
def test_peer_progress_flag_and_its_terminal_default(argv: list[str], tty: bool, enabled: bool) -> None:
    args = build_parser().parse_args(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX", *argv])
    assert progress_enabled(args, stderr_is_tty=tty) is enabled


@pytest.mark.parametrize("flag", ["--progress", "--no-progress"])
def test_peer_progress_goes_to_stderr_only_when_on(flag: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import swarmtrain.roles.process
    from swarmtrain.daemon import cmd_peer
    from swarmtrain.telemetry import EventWriter, LeaveEvent
    from swarmtrain.telemetry.console import ConsoleEventWriter, ConsoleProgress

    def fake_run_peer_process(local: object, *, local_overrides: object, coordinator_id: object,
                              progress: ConsoleProgress | None, metrics: object = None,
                              after_leave: object = None) -> int:
        writer = EventWriter(sys.stdout) if progress is None else ConsoleEventWriter(sys.stdout, progress)
        writer.emit(LeaveEvent(round=3, reason="done"))
        return 0

    monkeypatch.setattr(swarmtrain.roles.process, "run_peer_process", fake_run_peer_process)
    args = build_parser().parse_args(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX", flag])
    assert cmd_peer.run(args) == 0
    out, err = capsys.readouterr()
    assert out == '{"event": "leave", "round": 3, "reason": "done", "hash": "", "peer": "", "checkpoint": "", ' \
                  '"bytes_sent": 0, "bytes_received": 0}\n'
    assert err == ("left at round 3: done\n" if flag == "--progress" else "")


@pytest.mark.parametrize("argv", [["peer", "--join", "/ip4/10.0.0.1/tcp/1/p2p/QmX", "--host", "0.0.0.0"],
                                  ["coordinator", "--host", "0.0.0.0"],
                                  ["peer", "--join", "/ip4/10.0.0.1/tcp/1/p2p/QmX", "--set", "rpc.host=\"10.0.0.5\""]])
def test_an_empty_run_key_on_a_reachable_address_exits_with_one_line(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SWARMTRAIN_RUN_KEY", raising=False)
    args = build_parser().parse_args(argv)
    assert args._module.run(args) == 2  # refused before a socket or a process is opened
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"swarmtrain {argv[0]}: error: the run key is empty")
    assert "--insecure" in err[0] and "SWARMTRAIN_RUN_KEY" in err[0]


@pytest.mark.parametrize("command", ["coordinator", "peer"])
def test_tls_without_a_run_key_exits_with_one_line(command: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SWARMTRAIN_RUN_KEY", raising=False)
    join = ["--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX"] if command == "peer" else []
    args = build_parser().parse_args([command, *join, "--set", "rpc.tls=true"])
    assert args._module.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"swarmtrain {command}: error: rpc.tls needs a run key (its certificates are derived from it): "
                   "set SWARMTRAIN_RUN_KEY or rpc.run_key"]


def test_stage_without_the_server_role_exits_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--stage", "1",
                                      "--set", "rpc.run_key='k'"])
    assert args._module.run(args) == 2
    assert capsys.readouterr().err.strip() == "swarmtrain peer: error: --stage goes with --role server"


def test_an_island_launch_passes_every_flag_but_its_own_to_its_ranks() -> None:
    from swarmtrain.daemon.cmd_peer import _without_nproc

    argv = ["peer", "--join", "/ip4/1.2.3.4/tcp/1/p2p/QmX", "--nproc-per-node", "2", "--set", "train.threads=1",
            "--nproc-per-node=4"]
    assert _without_nproc(argv) == ["peer", "--join", "/ip4/1.2.3.4/tcp/1/p2p/QmX", "--set", "train.threads=1"]


@pytest.mark.parametrize(("extra", "env", "needle"), [
    (["--nproc-per-node", "0"], {}, "--nproc-per-node must be >= 1, got 0"),
    (["--nproc-per-node", "2", "--role", "server"], {}, "--role server runs on one process"),
    (["--role", "trainer"], {"WORLD_SIZE": "2", "RANK": "0"}, "--role trainer runs on one process"),
])
def test_an_island_refuses_what_it_cannot_run(extra: list[str], env: dict[str, str], needle: str,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from swarmtrain.daemon.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmX", *extra]) == 2
    assert needle in capsys.readouterr().err
