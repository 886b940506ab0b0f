"""System-test fixtures: a ProcessSet that kills every child (and its process group) after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from swarmtrain.testing.procs import ProcessSet


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call" and report.failed:
        procs = getattr(item, "funcargs", {}).get("procs")
        if isinstance(procs, ProcessSet):
            report.sections.append(("swarmtrain processes", procs.diagnostics()))
    return report


@pytest.fixture
def procs(tmp_path) -> Iterator[ProcessSet]:  # type: ignore[no-untyped-def]
    """Spawns `swarmtrain` subprocesses with logs under tmp_path/logs; nothing survives the test."""
    with ProcessSet(tmp_path / "logs") as ps:
        yield ps
