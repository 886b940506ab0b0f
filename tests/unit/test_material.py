"""A round's material (swarmtrain/averaging/material.py): the layout and its digests, checking a shard against
what the value names, and the store that keeps material (durably, with a spill directory) until it is old."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.averaging.aggregate import pack_bundle
from swarmtrain.averaging.material import (
    Material,
    MaterialError,
    MaterialStore,
    blob_digest,
    check_blob,
    check_shard,
    layout_key,
    layout_of,
)
from swarmtrain.compress import CodecError, get_codec
from swarmtrain.round.ballots import BallotError, MaterialLayout, ShardDigest

pytestmark = pytest.mark.unit

SHA_ABC = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"  # blake3(b"abc"), the reference vector
SHA_EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"  # blake3(b"")


def _blobs(tag: int, n: int = 3) -> list[bytes]:
    return [bytes([tag, j]) * (5 + j) for j in range(n)]


def _layout_for(blobs: list[bytes]) -> MaterialLayout:
    bounds = [(4 * j, 4 * j + 4) for j in range(len(blobs))]
    return layout_of(blobs, bounds, numel=4 * len(blobs), codec="fp32", gather=False)


def _material(blobs: list[bytes]) -> Material:
    m = Material(_layout_for(blobs))
    for j, b in enumerate(blobs):
        m.put(j, b)
    return m


# ---------------------------------------------------------------------------------------------- layout

def test_layout_of_names_each_shard_by_its_size_and_blake3() -> None:
    layout = layout_of([b"abc", b"", memoryview(b"abc")], [(0, 3), (3, 3), (3, 10)], numel=10, codec="int8",
                       gather=True)
    assert layout == MaterialLayout(10, "int8", True, (ShardDigest(0, 3, 3, SHA_ABC), ShardDigest(3, 3, 0, SHA_EMPTY),
                                                       ShardDigest(3, 10, 3, SHA_ABC)))
    assert blob_digest(b"abc") == SHA_ABC
    assert blob_digest(bytearray(b"abc")) == SHA_ABC
    assert blob_digest(b"") == SHA_EMPTY
    assert layout.size_bytes == 6


def test_layout_of_refuses_bounds_that_do_not_match() -> None:
    with pytest.raises(ValueError):  # one bound per blob
        layout_of([b"a", b"b"], [(0, 4)], numel=4, codec="fp32", gather=False)
    with pytest.raises(BallotError):  # the shards must cover numel
        layout_of([b"a"], [(0, 4)], numel=5, codec="fp32", gather=False)


def test_layout_key_differs_with_every_part_of_the_layout() -> None:
    blobs = _blobs(1)
    layout = _layout_for(blobs)
    assert layout_key(layout) == layout_key(_layout_for(list(blobs)))
    assert len(layout_key(layout)) == 64
    variants = [
        _layout_for(_blobs(2)),
        MaterialLayout(layout.numel, "fp16", False, layout.shards),
        MaterialLayout(layout.numel, "fp32", True, layout.shards),
        MaterialLayout(layout.numel, "fp32", False, (*layout.shards[:2], ShardDigest(8, 12, 7, "0" * 64))),
        MaterialLayout(layout.numel, "fp32", False,
                       (*layout.shards[:2], ShardDigest(8, 12, 8, layout.shards[2].digest))),
        MaterialLayout(12, "fp32", False, (ShardDigest(0, 6, 5, layout.shards[0].digest),
                                           ShardDigest(6, 8, 6, layout.shards[1].digest), layout.shards[2])),
    ]
    keys = {layout_key(v) for v in variants}
    assert len(keys) == len(variants) and layout_key(layout) not in keys


# ---------------------------------------------------------------------------------------------- checks

def test_a_shard_must_have_the_size_and_digest_the_value_names() -> None:
    blobs = _blobs(1)
    layout = _layout_for(blobs)
    check_blob(layout, 1, blobs[1])
    with pytest.raises(MaterialError, match="shard 1: 10 bytes, the value names 12"):
        check_blob(layout, 1, blobs[0])
    with pytest.raises(MaterialError, match="shard 1: 13 bytes"):
        check_blob(layout, 1, blobs[1] + b"x")
    tampered = bytes([blobs[1][0] ^ 1]) + blobs[1][1:]
    with pytest.raises(MaterialError, match="shard 1: its bytes do not hash"):
        check_blob(layout, 1, tampered)
    m = Material(layout)
    assert m.missing() == [0, 1, 2] and not m.complete
    with pytest.raises(MaterialError, match="do not hash"):
        m.put(1, tampered)
    assert m.blobs[1] is None, "a refused shard is not kept"
    m.put(1, blobs[1])
    m.put(0, blobs[0])
    assert m.missing() == [2] and not m.complete
    m.put(2, blobs[2])
    assert m.complete and m.missing() == []


def _fp32_layout(parts: list[bytes], numel: int, *, gather: bool) -> MaterialLayout:
    return layout_of(parts, [(0, numel)], numel=numel, codec="fp32", gather=gather)


def test_check_shard_takes_a_mean_that_decodes_as_the_layout_says() -> None:
    codec = get_codec("fp32")
    blob = codec.encode(torch.tensor([1.0, -2.0, 3.5, 0.0]))
    check_shard(codec, _fp32_layout([blob], 4, gather=False), 0, blob)
    bundle = pack_bundle([codec.encode(torch.tensor([1.0, 2.0])), codec.encode(torch.tensor([3.0, 4.0]))])
    check_shard(codec, _fp32_layout([bundle], 2, gather=True), 0, bundle)


def test_check_shard_refuses_another_codec_size_or_corrupt_bytes() -> None:
    codec = get_codec("fp32")
    blob = codec.encode(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    layout = _fp32_layout([blob], 4, gather=False)
    with pytest.raises(CodecError, match="codec 'fp32'; this peer's codec is 'fp16'"):
        check_shard(get_codec("fp16"), layout, 0, blob)
    five = codec.encode(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    with pytest.raises(CodecError):  # values of another size than the shard's
        check_shard(codec, layout, 0, five)
    corrupt = bytearray(blob)
    corrupt[-1] ^= 1
    with pytest.raises(CodecError):
        check_shard(codec, layout, 0, bytes(corrupt))
    with pytest.raises(CodecError):
        check_shard(codec, layout, 0, blob[:-1])


def test_check_shard_refuses_a_bundle_that_is_malformed_or_averages_to_inf() -> None:
    codec = get_codec("fp32")
    big = codec.encode(torch.tensor([3e38, 1.0]))
    bundle = pack_bundle([big, big])  # each finite, their sum is not
    with pytest.raises(CodecError, match="NaN or Inf"):
        check_shard(codec, _fp32_layout([bundle], 2, gather=True), 0, bundle)
    with pytest.raises(CodecError, match="bundle"):
        check_shard(codec, _fp32_layout([b"junk"], 2, gather=True), 0, b"junk")
    wrong_size = pack_bundle([codec.encode(torch.tensor([1.0, 2.0, 3.0]))])
    with pytest.raises(CodecError):
        check_shard(codec, _fp32_layout([wrong_size], 2, gather=True), 0, wrong_size)


# ---------------------------------------------------------------------------------------------- store

def test_the_store_holds_what_was_put_and_merges_partial_material() -> None:
    blobs = _blobs(3)
    layout = _layout_for(blobs)
    store = MaterialStore()
    assert not store.durable
    assert store.get(layout) is None and not store.holds(layout) and store.blob(layout, 0) is None
    first = Material(layout)
    first.put(0, blobs[0])
    key = store.put(4, first)
    assert key == layout_key(layout)
    assert not store.holds(layout) and store.blob(layout, 0) == blobs[0] and store.blob(layout, 1) is None
    second = Material(layout)
    second.put(1, blobs[1])
    second.put(2, blobs[2])
    assert store.put(4, second) == key
    assert store.holds(layout)
    assert [store.blob(layout, j) for j in range(3)] == blobs
    assert store.blob(layout, 3) is None and store.blob(layout, -1) is None
    store.make_durable(4, layout)  # without a spill directory: nothing to do, even for incomplete material
    store.make_durable(4, _layout_for(_blobs(9)))


def test_make_durable_writes_the_spill_directory_and_a_new_store_reloads_it(tmp_path: Path) -> None:
    blobs = _blobs(5)
    layout = _layout_for(blobs)
    store = MaterialStore(spill_dir=tmp_path, scope="stage2")
    assert store.durable
    store.put(7, _material(blobs))
    store.make_durable(7, layout)
    spill = tmp_path / "material-stage2"
    (entry,) = spill.iterdir()
    assert entry.name == f"r{7:010d}-{layout_key(layout)[:32]}"
    assert sorted(p.name for p in entry.iterdir()) == ["0", "1", "2"], "no temporary file is left"
    assert [(entry / str(j)).read_bytes() for j in range(3)] == blobs
    store.make_durable(7, layout)  # once is enough
    assert sorted(p.name for p in entry.iterdir()) == ["0", "1", "2"]
    # after a restart
    again = MaterialStore(spill_dir=tmp_path, scope="stage2")
    assert again.holds(layout)
    m = again.get(layout)
    assert m is not None and m.complete and [bytes(b) for b in m.blobs if b is not None] == blobs
    assert again.blob(layout, 2) == blobs[2]
    # another scope's store does not see it; nor a layout never stored
    assert not MaterialStore(spill_dir=tmp_path, scope="model").holds(layout)
    assert not again.holds(_layout_for(_blobs(6)))


def test_make_durable_fsyncs_every_shard_and_both_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = _blobs(5)
    layout = _layout_for(blobs)
    store = MaterialStore(spill_dir=tmp_path, scope="")
    store.put(1, _material(blobs))
    files: list[int] = []
    dirs: list[str] = []
    opened: dict[int, str] = {}
    real_open, real_fsync = os.open, os.fsync

    def spy_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        fd = real_open(path, flags, *args, **kw)
        opened[fd] = os.fspath(path)
        return fd

    def spy_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            dirs.append(opened[fd])
        else:
            files.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    store.make_durable(1, layout)
    spill = tmp_path / "material-model"
    assert len(files) == 3
    assert dirs == [os.fspath(spill / f"r{1:010d}-{layout_key(layout)[:32]}"), os.fspath(spill)]


def test_make_durable_refuses_incomplete_or_unknown_material(tmp_path: Path) -> None:
    blobs = _blobs(5)
    layout = _layout_for(blobs)
    store = MaterialStore(spill_dir=tmp_path)
    with pytest.raises(MaterialError, match="incomplete"):
        store.make_durable(2, layout)
    partial = Material(layout)
    partial.put(0, blobs[0])
    store.put(2, partial)
    with pytest.raises(MaterialError, match="incomplete"):
        store.make_durable(2, layout)
    assert not (tmp_path / "material-model").exists() or not any((tmp_path / "material-model").iterdir())
    assert not MaterialStore(spill_dir=tmp_path).holds(layout)
    # once complete it goes
    rest = Material(layout)
    rest.put(1, blobs[1])
    rest.put(2, blobs[2])
    store.put(2, rest)
    store.make_durable(2, layout)
    assert MaterialStore(spill_dir=tmp_path).holds(layout)


def test_stored_material_that_no_longer_matches_its_digests_is_not_held(tmp_path: Path) -> None:
    blobs = _blobs(5)
    layout = _layout_for(blobs)
    store = MaterialStore(spill_dir=tmp_path)
    store.put(3, _material(blobs))
    store.make_durable(3, layout)
    (entry,) = (tmp_path / "material-model").iterdir()
    (entry / "1").write_bytes(b"\0" * len(blobs[1]))
    again = MaterialStore(spill_dir=tmp_path)
    assert again.get(layout) is None and not again.holds(layout)
    (entry / "1").unlink()
    assert not MaterialStore(spill_dir=tmp_path).holds(layout)


def test_forget_before_drops_old_rounds_from_memory_and_disk(tmp_path: Path) -> None:
    old_blobs, edge_blobs, new_blobs, mem_blobs = _blobs(10), _blobs(11), _blobs(12), _blobs(13)
    old, edge, new, mem = (_layout_for(b) for b in (old_blobs, edge_blobs, new_blobs, mem_blobs))
    store = MaterialStore(spill_dir=tmp_path)
    for r, blobs in ((3, old_blobs), (5, edge_blobs), (6, new_blobs)):
        store.put(r, _material(blobs))
        store.make_durable(r, _layout_for(blobs))
    store.put(4, _material(mem_blobs))  # in memory only
    spill = tmp_path / "material-model"
    assert len(list(spill.iterdir())) == 3
    store.forget_before(5)
    assert not store.holds(old) and store.get(old) is None
    assert not store.holds(mem) and store.get(mem) is None
    assert store.holds(edge) and store.holds(new)
    assert sorted(p.name[:11] for p in spill.iterdir()) == [f"r{5:010d}", f"r{6:010d}"]
    restarted = MaterialStore(spill_dir=tmp_path)
    assert not restarted.holds(old)
    assert restarted.holds(edge) and restarted.holds(new)
    # a restarted store forgets what it reloaded, too
    restarted.forget_before(7)
    assert not restarted.holds(edge) and not restarted.holds(new)
    assert list(spill.iterdir()) == []
    assert not MaterialStore(spill_dir=tmp_path).holds(new)


def test_forget_before_without_a_spill_directory() -> None:
    a, b = _blobs(20), _blobs(21)
    store = MaterialStore()
    store.put(1, _material(a))
    store.put(2, _material(b))
    store.forget_before(2)
    assert not store.holds(_layout_for(a)) and store.holds(_layout_for(b))
    store.forget_before(3)
    assert not store.holds(_layout_for(b))



def test_the_same_material_chosen_in_two_rounds_is_kept_for_the_newer_one(tmp_path: Path) -> None:
    """Two rounds can choose the same bytes (a Δ that did not change): forgetting the older round keeps them,
    in memory and on disk, and a restart finds them under the newer round."""
    blobs = _blobs(30)
    layout = _layout_for(blobs)
    store = MaterialStore(spill_dir=tmp_path)
    store.put(0, _material(blobs))
    store.make_durable(0, layout)
    store.put(1, _material(blobs))
    store.make_durable(1, layout)
    store.put(0, _material(blobs))  # an older round naming it again does not make it older
    store.forget_before(1)
    assert store.holds(layout)
    spill = tmp_path / "material-model"
    assert [p.name[:11] for p in spill.iterdir()] == [f"r{1:010d}"]
    assert MaterialStore(spill_dir=tmp_path).holds(layout)
    store.forget_before(2)
    assert not store.holds(layout) and list(spill.iterdir()) == []


def test_material_forgotten_on_disk_but_chosen_again_in_memory_is_written_anew(tmp_path: Path) -> None:
    blobs = _blobs(31)
    layout = _layout_for(blobs)
    store = MaterialStore(spill_dir=tmp_path)
    store.put(0, _material(blobs))
    store.make_durable(0, layout)
    store.put(2, _material(blobs))  # chosen again two rounds later, not yet durable for it
    store.forget_before(1)  # round 0's directory goes; the memory keeps the bytes for round 2
    assert store.holds(layout)
    store.make_durable(2, layout)
    assert [p.name[:11] for p in (tmp_path / "material-model").iterdir()] == [f"r{2:010d}"]
    assert MaterialStore(spill_dir=tmp_path).holds(layout)
