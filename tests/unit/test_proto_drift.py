"""The committed generated code in swarmtrain/wire must match what proto/ generates now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_generated_wire_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p.relative_to(REPO / "proto")) for p in (REPO / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *protos],
        cwd=REPO, check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc generated nothing"
    committed = sorted(p.relative_to(REPO) for p in (REPO / "swarmtrain" / "wire").glob("*_pb2*.py*"))
    assert [str(p) for p in generated] == [str(p) for p in committed], (
        "generated file set drifted: run scripts/gen_proto.sh")
    for rel in generated:
        assert (tmp_path / rel).read_text() == (REPO / rel).read_text(), (
            f"{rel} drifted from proto/: run scripts/gen_proto.sh")
