"""The configuration reference: docs/configuration.md is the command's output, and every field has a meaning."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmtrain.config import RunConfig
from swarmtrain.daemon.cli import main
from swarmtrain.daemon.config_reference import COMMAND, field_docs, render_reference, undocumented_fields

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@dataclass(frozen=True)
class _Throwaway:
    """A section as a contributor might write it: one field documented, one not."""

    documented: int = 1
    """Something, in seconds."""
    forgotten: str = ""
    # a comment is not a docstring
    spaced: float = 0.5
    """A meaning over
    two lines."""


def test_committed_reference_is_the_commands_output() -> None:
    assert DOC.read_text(encoding="utf-8") == render_reference(), (
        f"{DOC.name} is out of date: run `{COMMAND} > docs/configuration.md` and commit the result")


def test_command_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "reference"]) == 0
    assert capsys.readouterr().out == render_reference()


def test_reference_takes_no_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "reference", "--set", "outer.lr=1"]) == 2
    assert "takes no --config or --set" in capsys.readouterr().err


def test_every_field_of_every_section_has_a_meaning() -> None:
    for section in dataclasses.fields(RunConfig):
        cls = type(getattr(RunConfig(), section.name))
        assert undocumented_fields(cls) == [], f"[{section.name}]: add a docstring under each of these fields"
        assert cls.__doc__, f"[{section.name}]: {cls.__name__} needs a class docstring"


def test_every_field_is_in_the_reference_with_its_scope() -> None:
    text = render_reference()
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(type(getattr(RunConfig(), section.name))):
            assert f"| `{section.name}.{f.name}` |" in text
    assert "| `train.device` | str | `\"auto\"` | peer |" in text
    assert "| `compress.codec` | str | `\"int8\"` | run |" in text
    assert "| `rpc.port` | int | `0` | peer |" in text


def test_a_field_added_without_a_meaning_is_caught() -> None:
    assert undocumented_fields(_Throwaway) == ["forgotten"]
    docs = field_docs(_Throwaway)
    assert docs == {"documented": "Something, in seconds.", "forgotten": "", "spaced": "A meaning over two lines."}
