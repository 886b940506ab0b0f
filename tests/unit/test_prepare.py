"""`data prepare` against a direct tokenization, its inputs' errors, and reading the shards back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmtrain.config import DataConfig
from swarmtrain.data import ShardedBatches, eval_batches, load_corpus
from swarmtrain.data.order import FeistelPermutation
from swarmtrain.data.prepare import PrepareOptions, prepare
from swarmtrain.data.readers import InputError, iter_pieces
from swarmtrain.data.shards import ShardError, TokenShards
from swarmtrain.data.tokenizer import encode_arrays, load_tokenizer

pytestmark = pytest.mark.unit

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet, " * (i % 7 + 1) + "é\n" for i in range(300)]


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    jsonl, text = tmp_path / "a.jsonl", tmp_path / "b.txt"
    jsonl.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS[:200])) + "\n")
    text.write_text("".join(DOCS[200:]) * 20, encoding="utf-8")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": DOCS[::3], "other": list(range(100))}), parquet, row_group_size=17)
    return jsonl, text, parquet


def _expected(paths: list[str], *, tokenizer: str, field: str, stride: int) -> dict[bool, np.ndarray]:
    """The token streams a one-process, in-memory tokenization gives (the manifest's rule for the split)."""
    tok = load_tokenizer(tokenizer)
    out: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for n, piece in enumerate(iter_pieces(paths, field=field, piece_bytes=4096), start=1):
        (ids,) = encode_arrays(tok, [piece.text])
        out[n % stride == 0] += [ids] + ([np.array([tok.info.eos_id])] if piece.ends_document else [])
    return {k: np.concatenate(v) for k, v in out.items()}


def _stream(shards: TokenShards, split: str) -> np.ndarray:
    s = shards.train if split == "train" else shards.val
    return s.windows(np.array([0]), s.numel())[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_hold_the_direct_tokenization(tmp_path: Path, workers: int) -> None:
    jsonl, text, _ = _files(tmp_path)
    out = tmp_path / "shards"
    result = prepare(PrepareOptions(inputs=(str(jsonl), str(text)), out=str(out), val_fraction=0.1, workers=workers,
                                    shard_tokens=3000, piece_bytes=4096, batch_bytes=5000))
    want = _expected([str(jsonl), str(text)], tokenizer="bytes", field="text", stride=10)
    shards = TokenShards.open(out)
    shards.verify()
    assert len(result.manifest["splits"]["train"]["shards"]) > 3  # rolled over at shard_tokens
    assert np.array_equal(_stream(shards, "train"), want[False])
    assert np.array_equal(_stream(shards, "val"), want[True])
    assert result.manifest["documents"] == 200 + 1 and result.manifest["dtype"] == "uint16"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_parquet_and_datasets_with_a_trained_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    datasets = pytest.importorskip("datasets")
    from swarmtrain.data.tokenizer_train import train_bpe

    _, _, parquet = _files(tmp_path)
    tok = tmp_path / "tok.json"
    train_bpe(iter(DOCS), vocab_size=300, out=tok)
    saved = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS[1::3]})}).save_to_disk(str(saved))
    prepare(PrepareOptions(inputs=(str(parquet), str(saved)), out=str(tmp_path / "s"), tokenizer=str(tok),
                           field="body", val_fraction=0.05, workers=2))
    want = _expected([str(parquet), str(saved)], tokenizer=str(tok), field="body", stride=20)
    shards = TokenShards.open(tmp_path / "s")
    assert np.array_equal(_stream(shards, "train"), want[False])
    assert shards.manifest["tokenizer"]["hash"] == load_tokenizer(str(tok)).info.hash


def _fails(tmp_path: Path, inputs: list[Path], match: str, **kw: object) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        prepare(PrepareOptions(inputs=tuple(str(p) for p in inputs), out=str(out), workers=1, **kw))  # type: ignore[arg-type]
    left = [p.name for p in tmp_path.iterdir() if p.name == "out" or ".partial" in p.name]
    assert not left, f"a failed prepare left {left}"


def test_bad_inputs_are_named_and_leave_nothing(tmp_path: Path) -> None:
    jsonl, _, parquet = _files(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{not json\n')
    _fails(tmp_path, [jsonl, bad], rf"{bad}:3: not a JSON line")
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    _fails(tmp_path, [bad], rf"{bad}:2: no field 'text'")
    bad.write_text('{"text": 3}\n')
    _fails(tmp_path, [bad], rf"{bad}:1: field 'text' is a int, not a string")
    _fails(tmp_path, [parquet], rf"{parquet}: no column 'text' \(columns: body, other")
    _fails(tmp_path, [tmp_path / "nope.txt"], "nope.txt: no such file")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"abc\xe9def\n")
    _fails(tmp_path, [latin], rf"{latin}: not UTF-8 text at byte 3")
    _fails(tmp_path, [jsonl], "unknown tokenizer file", tokenizer=str(parquet))
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match="already exists"):
        prepare(PrepareOptions(inputs=(str(jsonl),), out=str(tmp_path / "out"), workers=1))


def test_shards_of_another_tokenizer_or_torn_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from swarmtrain.data.tokenizer_train import train_bpe

    jsonl, _, _ = _files(tmp_path)
    out = tmp_path / "shards"
    prepare(PrepareOptions(inputs=(str(jsonl),), out=str(out), val_fraction=0.1, workers=1))
    tok = tmp_path / "tok.json"
    train_bpe(iter(DOCS), vocab_size=300, out=tok)
    with pytest.raises(ShardError, match=rf"{out / 'manifest.json'}: the shards were tokenized with another tokenizer"):
        load_corpus(DataConfig(shards=str(out), tokenizer=str(tok)))
    shard = out / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ShardError, match=rf"{shard}: .* bytes, the manifest says"):
        load_corpus(DataConfig(shards=str(out)))
    with pytest.raises(ShardError, match=r"no manifest\.json"):
        TokenShards.open(tmp_path)


def test_batches_from_shards_read_the_stream_as_a_tensor_would(tmp_path: Path) -> None:
    jsonl, text, _ = _files(tmp_path)
    prepare(PrepareOptions(inputs=(str(jsonl), str(text)), out=str(tmp_path / "s"), val_fraction=0.1, workers=1,
                           shard_tokens=1000))
    corpus = load_corpus(DataConfig(shards=str(tmp_path / "s")))
    whole = torch.from_numpy(_stream(TokenShards.open(tmp_path / "s"), "train").astype(np.int64))
    seen: list[set[int]] = []
    for k in range(3):
        stream = ShardedBatches(corpus.train, worker_index=k, num_workers=3, batch_size=4, seq_len=31, seed=2)
        windows: set[int] = set()
        for step in range(stream.steps_per_epoch):
            x, y = stream.batch_at(step)
            starts = stream.windows_at(step) * 32
            ref = whole[starts[:, None] + torch.arange(32)[None, :]]  # across shard ends too
            assert torch.equal(x, ref[:, :-1]) and torch.equal(y, ref[:, 1:])
            windows |= set(stream.windows_at(step).tolist())
        seen.append(windows)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    val = eval_batches(corpus.val, batch_size=2, seq_len=15, num_batches=2)
    assert len(val) == 2 and val[0][0].shape == (2, 15)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_feistel_order_is_a_permutation(n: int) -> None:
    perm = FeistelPermutation(n, seed=3)(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n > 10:
        assert not np.array_equal(perm, FeistelPermutation(n, seed=4)(np.arange(n)))
        assert not np.array_equal(perm, np.arange(n))
