"""The CLI turns every user-facing error into one line on stderr and a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmtrain.daemon.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["config", "show", "--set", "outer.lr=-1"], "outer.lr: must be > 0"),
        (["config", "show", "--set", "diloco.bogus=1"], "diloco.bogus: unknown key"),
        (["config", "show", "--config", "/nonexistent/run.toml"], "config file not found"),
    ],
)
def test_user_errors_are_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith(f"swarmtrain {argv[0]}: error:")


def test_corpus_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc = main(["simulate", "--workers", "1", "--rounds", "1", "--inner-steps", "1", "--data", str(empty),
               "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "corpus too small" in err[0]
