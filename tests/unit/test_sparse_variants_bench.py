"""`benchmarks/sparse_variants.py`: its random positions are what the table says they are."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import swarmtrain.compress.sparse as sparse
from swarmtrain.diloco.worker import DilocoWorker

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def variants(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # it imports convergence.py as a sibling
    # use_random_positions swaps these in place: record them so that teardown puts them back
    monkeypatch.setattr(sparse, "_select", sparse._select)
    monkeypatch.setattr(DilocoWorker, "delta", DilocoWorker.delta)
    spec = importlib.util.spec_from_file_location("sparse_variants_bench", BENCH / "sparse_variants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _offsets(x: torch.Tensor, k: int) -> torch.Tensor:
    return sparse._select(x.view(-1, 256), k)


def test_parse_arm(variants: ModuleType) -> None:
    assert variants.parse_arm("a=compress.density=0.02") == ("a", "topk", ("compress.density=0.02",))
    assert variants.parse_arm("b=positions=own,outer.lr=1.5") == ("b", "own", ("outer.lr=1.5",))
    with pytest.raises(SystemExit, match="positions='near'"):
        variants.parse_arm("c=positions=near")
    with pytest.raises(SystemExit, match="give NAME="):
        variants.parse_arm("d")


def test_shared_positions_are_the_rounds_not_the_values(variants: ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the swap wraps delta(): give it one that a stand-in worker can run (the fixture restores the real one)
    monkeypatch.setattr(DilocoWorker, "delta", lambda self: torch.zeros(1))
    variants.use_random_positions("shared")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, generator=gen), torch.randn(1024, generator=gen)
    first = _offsets(a, 20)
    assert torch.equal(first, _offsets(b, 20))  # another peer's Δ, the same round: the same positions
    assert first.shape == (4, 20) and bool((first.diff(dim=1) > 0).all()) and int(first.max()) < 256
    top = a.view(-1, 256).abs().topk(20, dim=1).indices.sort(dim=1).values
    assert not torch.equal(first, top)  # not the largest values
    # the round is the one the last delta() ran in
    assert torch.equal(DilocoWorker.delta(type("Worker", (), {"round": 7})()), torch.zeros(1))  # type: ignore[arg-type]
    assert not torch.equal(first, _offsets(a, 20))  # round 7 draws other positions


def test_own_positions_follow_the_values(variants: ModuleType) -> None:
    variants.use_random_positions("own")
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1024, generator=gen), torch.randn(1024, generator=gen)
    assert torch.equal(_offsets(a, 20), _offsets(a.clone(), 20))  # error feedback's round trip agrees
    assert not torch.equal(_offsets(a, 20), _offsets(b, 20))  # each peer picks its own


def test_round_trip_keeps_values_at_the_drawn_positions(variants: ModuleType) -> None:
    variants.use_random_positions("shared")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    body = sparse.sparse_encode(x, chunk=4096, k=64, bits=8)
    out = torch.zeros(4096)
    sparse.sparse_decode_accumulate(body, numel=4096, chunk=4096, k=64, bits=8, out=out)
    kept = out.nonzero().view(-1)
    assert torch.equal(kept, sparse._select(x.view(1, -1), 64)[0])
    assert torch.equal(out[kept].sign(), x[kept].sign())


def test_offset_bytes_is_the_offsets_region(variants: ModuleType) -> None:
    config = {"compress": {"chunk_size": 4096, "density": 0.01, "bits": 2}}
    k = 41  # round(0.01 × 4096)
    assert variants.offset_bytes(config, 3 * 4096) == 3 * -(-k * 12 // 8)
