"""`benchmarks/sparse_variants.py`: its swapped positions and mean are what the table says they are."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import swarmtrain.averaging.inprocess as inprocess
import swarmtrain.compress.sparse as sparse
from swarmtrain.compress import get_codec
from swarmtrain.compress.sparse_codec import SparseCodec
from swarmtrain.diloco.worker import DilocoWorker

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def variants(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # it imports convergence.py as a sibling
    # use_random_positions swaps these in place: record them so that teardown puts them back
    monkeypatch.setattr(sparse, "_select", sparse._select)
    monkeypatch.setattr(sparse, "sparse_encode", sparse.sparse_encode)
    monkeypatch.setattr(inprocess, "mean_of_gathered", inprocess.mean_of_gathered)
    monkeypatch.setattr(DilocoWorker, "delta", DilocoWorker.delta)
    spec = importlib.util.spec_from_file_location("sparse_variants_bench", BENCH / "sparse_variants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _offsets(x: torch.Tensor, k: int) -> torch.Tensor:
    return sparse._select(x.view(-1, 256), k)


def test_parse_arm(variants: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    assert variants.parse_arm("a=compress.density=0.02") == ("a", "topk", "mean", ("compress.density=0.02",))
    assert variants.parse_arm("b=positions=own,outer.lr=1.5") == ("b", "own", "mean", ("outer.lr=1.5",))
    assert variants.parse_arm("e=combine=count,positions=tensors") == ("e", "tensors", "count", ())
    with pytest.raises(SystemExit, match="positions='near'"):
        variants.parse_arm("c=positions=near")
    with pytest.raises(SystemExit, match="combine='median'"):
        variants.parse_arm("c=combine=median")
    monkeypatch.setenv("SWARMTRAIN_KERNELS", "torch")  # main() sets it: teardown puts the old value back
    with pytest.raises(SystemExit, match="has none"):
        variants.main(["--arm", "f=combine=count,averaging.combine=reencode"])
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


def test_tensor_positions_split_k_by_length(variants: ModuleType) -> None:
    # θ of 3 parameters: [0, 100) with tiny values, [100, 356) with large ones, [356, 612)
    starts = [0, 100, 356, 612]
    x = torch.randn(612, generator=torch.Generator().manual_seed(3))
    x[:100] *= 1e-3
    plain = _offsets(torch.cat([x, torch.zeros(156)]), 16)  # top-k of the same chunks (the tail padded)
    assert int((plain[0] < 100).sum()) == 0  # top-k spends the straddling chunk on the large parameter
    variants.use_tensor_positions(starts)
    body = sparse.sparse_encode(x, chunk=256, k=16, bits=8)
    out = torch.zeros(612)
    sparse.sparse_decode_accumulate(body, numel=612, chunk=256, k=16, bits=8, out=out)
    kept = out.nonzero().view(-1)
    # chunk 0 = 100 + 156 values of two parameters: k 16 splits 6.25 / 9.75 -> 6 / 10
    assert int((kept < 100).sum()) == 6 and int(((kept >= 100) & (kept < 256)).sum()) == 10
    assert torch.equal(kept[kept < 100].sort().values, x[:100].abs().topk(6).indices.sort().values)
    # chunk 1 = [256, 356) of the second and [356, 512) of the third: 6.25 / 9.75 -> 6 / 10
    assert int(((kept >= 256) & (kept < 356)).sum()) == 6 and int(((kept >= 356) & (kept < 512)).sum()) == 10
    # the last chunk ([512, 612), 100 values) lies in one parameter: its plain top-k
    last_k = sparse.sparse_layout(612, chunk=256, k=16, bits=8).last_k
    tail = kept[kept >= 512] - 512
    assert torch.equal(tail, x[512:].abs().topk(last_k).indices.sort().values)
    with pytest.raises(ValueError, match="all of θ"):
        sparse.sparse_encode(x[:256], chunk=256, k=16, bits=8)


def test_parameter_starts_cover_the_model(variants: ModuleType) -> None:
    starts = variants.parameter_starts(("model.preset=tiny",))
    assert starts[0] == 0 and starts[-1] == 131_712  # tiny's parameters, the tied head counted once
    assert all(b > a for a, b in itertools.pairwise(starts))


def test_count_mean_divides_by_the_members_that_sent(variants: ModuleType) -> None:
    variants.use_count_mean()
    codec = SparseCodec(density=0.5, bits=8, chunk_size=4)
    a = torch.tensor([4.0, 0.0, 0.0, 2.0])
    b = torch.tensor([2.0, 0.0, 3.0, 0.0])
    parts = [codec.encode(a), codec.encode(b)]
    got = inprocess.mean_of_gathered(codec, parts, out=torch.empty(4))
    want = torch.zeros(4)
    for part, d in zip(parts, (a, b), strict=True):
        assert torch.equal(codec.decode(part).reshape(-1).sign(), d.sign())
    decoded = [codec.decode(p).reshape(-1) for p in parts]
    want[0] = (decoded[0][0] + decoded[1][0]) / 2  # both sent it
    want[2], want[3] = decoded[1][2], decoded[0][3]  # one each: not halved
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no contributions"):
        inprocess.mean_of_gathered(get_codec("int8"), [], out=torch.empty(4))
