"""Corpus loading and sharding: deterministic, disjoint, resumable; clear errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmtrain.config import DataConfig
from swarmtrain.data import CorpusError, ShardedBatches, eval_batches, load_corpus, stdlib_files

pytestmark = pytest.mark.unit


def test_stdlib_corpus_is_deterministic_and_excludes_site_packages() -> None:
    files = stdlib_files()
    assert len(files) > 100
    assert not any("site-packages" in p.parts for p in files)
    assert files == stdlib_files()
    a = load_corpus(DataConfig(max_corpus_bytes=500_000))
    assert a.train.dtype == torch.uint8 and a.train.numel() + a.val.numel() == 500_000


def test_user_files_split_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("hello world\n" * 500)
    c = load_corpus(DataConfig(paths=(str(f),)))
    assert bytes(c.train[:5].tolist()) == b"hello"
    with pytest.raises(CorpusError, match="data file not found"):
        load_corpus(DataConfig(paths=(str(tmp_path / "missing.txt"),)))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CorpusError, match="corpus too small"):
        load_corpus(DataConfig(paths=(str(empty),)))


def _windows(k: int, num_workers: int, steps: int) -> set[int]:
    tokens = torch.arange(10_000) % 256
    s = ShardedBatches(tokens.to(torch.uint8), worker_index=k, num_workers=num_workers,
                       batch_size=4, seq_len=15, seed=3)
    return {int(w) for t in range(steps) for w in s.windows_at(t)}


def test_workers_see_disjoint_windows() -> None:
    seen = [_windows(k, 4, steps=9) for k in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not seen[i] & seen[j]
    assert sum(len(s) for s in seen) == 4 * 9 * 4


def test_resume_is_exact() -> None:
    tokens = (torch.arange(20_000) % 251).to(torch.uint8)
    kw = dict(worker_index=1, num_workers=2, batch_size=3, seq_len=31, seed=5)
    a = ShardedBatches(tokens, **kw)
    for _ in range(7):
        next(a)
    b = ShardedBatches(tokens, **kw)
    b.load_state_dict(a.state_dict())
    xa, ya = next(a)
    xb, yb = next(b)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    with pytest.raises(ValueError, match="worker_index"):
        ShardedBatches(tokens, **{**kw, "worker_index": 0}).load_state_dict(a.state_dict())


def test_eval_batches_fixed() -> None:
    tokens = (torch.arange(5_000) % 256).to(torch.uint8)
    a = eval_batches(tokens, batch_size=4, seq_len=31, num_batches=3)
    assert len(a) == 3 and a[0][0].shape == (4, 31)


@pytest.mark.parametrize(("key", "value"), [("batch_size", 4), ("seq_len", 15), ("seed", 6), ("num_workers", 3)])
def test_resume_refuses_a_different_stream_layout(key: str, value: int) -> None:
    tokens = (torch.arange(20_000) % 251).to(torch.uint8)
    kw = dict(worker_index=1, num_workers=2, batch_size=3, seq_len=31, seed=5)
    state = ShardedBatches(tokens, **kw).state_dict()
    with pytest.raises(ValueError, match=f"saved with {key}="):
        ShardedBatches(tokens, **{**kw, key: value}).load_state_dict(state)
    with pytest.raises(ValueError, match="num_windows"):
        ShardedBatches(tokens[:10_000], **kw).load_state_dict(state)  # another corpus
    with pytest.raises(ValueError, match="no 'seq_len'"):
        ShardedBatches(tokens, **kw).load_state_dict({k: v for k, v in state.items() if k != "seq_len"})
