"""Where a voter keeps its votes (swarmtrain/sync/votes.py): the crash-safe file per scope (temporary file,
fsync, rename, directory fsync), its refusal to vote from a book it cannot read, and the memory store."""

from __future__ import annotations

import json
import os
import random
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.round.acceptor import AcceptorState
from swarmtrain.round.ballots import MaterialLayout, ShardDigest, Value, Voter, session_ballot
from swarmtrain.sync.votes import MAX_STORE_BYTES, FileVoteStore, MemoryVoteStore, VoteStoreError, votes_file

pytestmark = pytest.mark.unit


def _value(scope: str, round_index: int) -> Value:
    layout = MaterialLayout(4, "fp32", False, (ShardDigest(0, 4, 16, "a" * 64),))
    return Value(scope, round_index, "sess", "", ("p",), (Voter("p", 0),), layout, "b" * 64)


def _state(scope: str = "model", incarnation: int = 5, rounds: int = 3) -> AcceptorState:
    st = AcceptorState(scope=scope, incarnation=incarnation)
    for r in range(rounds):
        st.accept(r, session_ballot(r, 0, "sess"), _value(scope, r), horizon=100)
        st.sign_accepted(r, bytes([r]) * 64)
    st.prepare(rounds, session_ballot(9, 1, "x"), horizon=100)
    return st


def test_a_new_directory_is_created_and_reloads_what_was_saved(tmp_path: Path) -> None:
    directory = tmp_path / "not" / "yet"
    store = FileVoteStore(directory, rng=random.Random(11))
    fresh = store.load("model")
    assert fresh == AcceptorState(scope="model", incarnation=random.Random(11).randrange(1 << 40))
    assert not directory.exists(), "loading creates nothing"
    st = _state()
    st.retire(current_round=2)
    st.sign_retirement(b"r" * 64)
    st.reincarnate()
    st.accept(4, session_ballot(4, 0, "sess"), _value("model", 4), horizon=100)
    store.save(st)
    assert directory.is_dir()
    path = directory / "votes-model.json"
    assert path == votes_file(directory, "model")
    raw = json.loads(path.read_text())
    assert raw["format"] == 2 and raw["state"] == st.to_json()
    assert sorted(p.name for p in directory.iterdir()) == ["votes-model.json"], "no temporary file is left"
    again = FileVoteStore(directory, rng=random.Random(99)).load("model")
    assert again == st
    assert again.incarnation == 6, "a saved book keeps its incarnation (no new draw)"
    # saved again over the old book
    st.forget_before(3)
    store.save(st)
    assert FileVoteStore(directory).load("model") == st


def test_the_unnamed_scope_is_the_model_file(tmp_path: Path) -> None:
    assert votes_file(tmp_path, "") == tmp_path / "votes-model.json"
    assert votes_file(tmp_path, "stage2") == tmp_path / "votes-stage2.json"
    store = FileVoteStore(tmp_path)
    store.save(_state(scope=""))
    assert store.load("") == _state(scope="")
    with pytest.raises(VoteStoreError, match="scope ''"):  # the same file, another scope's votes
        store.load("model")


def test_save_fsyncs_the_file_then_renames_then_fsyncs_the_directory(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "votes"
    events: list[tuple[str, Any]] = []
    opened: dict[int, str] = {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def spy_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        fd = real_open(path, flags, *args, **kw)
        opened[fd] = os.fspath(path)
        return fd

    def spy_fsync(fd: int) -> None:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        events.append(("fsync-dir" if is_dir else "fsync-file", opened.get(fd) if is_dir else None))
        real_fsync(fd)

    def spy_replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    FileVoteStore(directory).save(_state())
    assert events == [("fsync-file", None), ("replace", os.fspath(directory / "votes-model.json")),
                      ("fsync-dir", os.fspath(directory))]


@pytest.mark.parametrize("content", [b"", b"not json{", b"[]", b'{"format": 1, "state": {}}',
                                     b'{"format": 2}', b'{"format": 2, "state": {"scope": "model"}}',
                                     b'{"format": 2, "state": {"scope": "model", "incarnation": -1, "floor": 0}}',
                                     b"\xff\xfe\x00"])
def test_a_garbage_book_is_an_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "votes-model.json"
    path.write_bytes(content)
    with pytest.raises(VoteStoreError) as e:
        FileVoteStore(tmp_path).load("model")
    assert str(path) in str(e.value)


def test_a_book_of_a_malformed_vote_is_an_error_naming_the_file(tmp_path: Path) -> None:
    raw = _state().to_json()
    raw["rounds"]["1"]["accepted"] = [0, 0]
    path = tmp_path / "votes-model.json"
    path.write_text(json.dumps({"format": 2, "state": raw}))
    with pytest.raises(VoteStoreError, match="unreadable vote book") as e:
        FileVoteStore(tmp_path).load("model")
    assert str(path) in str(e.value)


def test_a_book_with_a_malformed_past_entry_is_an_error_naming_the_file(tmp_path: Path) -> None:
    raw = _state().to_json()
    raw["past"] = {"1": {"incarnation": 4}}
    path = tmp_path / "votes-model.json"
    path.write_text(json.dumps({"format": 2, "state": raw}))
    with pytest.raises(VoteStoreError) as e:
        FileVoteStore(tmp_path).load("model")
    assert str(path) in str(e.value)


def test_an_unreadable_or_oversized_book_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "votes-model.json"
    path.mkdir()  # a directory where the book should be: it cannot be read
    with pytest.raises(VoteStoreError) as e:
        FileVoteStore(tmp_path).load("model")
    assert str(path) in str(e.value)
    big = tmp_path / "votes-stage1.json"
    with open(big, "wb") as f:
        f.truncate(MAX_STORE_BYTES + 1)
    with pytest.raises(VoteStoreError, match=f"{MAX_STORE_BYTES + 1} bytes") as e:
        FileVoteStore(tmp_path).load("stage1")
    assert str(big) in str(e.value)


def test_a_book_that_cannot_be_written_is_an_error_naming_the_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(VoteStoreError, match="cannot record a vote") as e:
        FileVoteStore(blocker / "votes").save(_state())  # its parent is a file
    assert str(blocker / "votes" / "votes-model.json") in str(e.value)


def test_two_scopes_keep_separate_files_and_votes(tmp_path: Path) -> None:
    store = FileVoteStore(tmp_path)
    model, stage = _state("model", 1, rounds=2), _state("stage2", 2, rounds=4)
    store.save(model)
    store.save(stage)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["votes-model.json", "votes-stage2.json"]
    stage_bytes = (tmp_path / "votes-stage2.json").read_bytes()
    model.accept(7, session_ballot(7, 0, "sess"), _value("model", 7), horizon=100)
    store.save(model)
    assert (tmp_path / "votes-stage2.json").read_bytes() == stage_bytes, "saving one scope leaves the other"
    fresh = FileVoteStore(tmp_path)
    assert fresh.load("model") == model and fresh.load("stage2") == stage
    assert 7 not in fresh.load("stage2").rounds
    assert fresh.load("model").incarnation == 1 and fresh.load("stage2").incarnation == 2
    # a scope never saved starts fresh, in the same directory
    assert fresh.load("ends").rounds == {}


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "a-store-per-thread"])
def test_concurrent_saves_never_raise_and_leave_one_saved_state(tmp_path: Path, shared: bool) -> None:
    threads_n, saves_n = 6, 8
    states = [[_state(incarnation=100 * t + i, rounds=1 + (t + i) % 4) for i in range(saves_n)]
              for t in range(threads_n)]
    one = FileVoteStore(tmp_path / "votes")
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def work(t: int) -> None:
        store = one if shared else FileVoteStore(tmp_path / "votes")
        try:
            start.wait()
            for st in states[t]:
                store.save(st)
        except BaseException as e:  # recorded and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    path = tmp_path / "votes" / "votes-model.json"
    raw = json.loads(path.read_text())  # valid JSON
    saved = {json.dumps(st.to_json(), sort_keys=True) for row in states for st in row}
    assert json.dumps(raw["state"], sort_keys=True) in saved
    # and it is each thread's last: a thread's later save never lands before its earlier one
    last = {json.dumps(row[-1].to_json(), sort_keys=True) for row in states}
    assert json.dumps(raw["state"], sort_keys=True) in last
    assert FileVoteStore(tmp_path / "votes").load("model").to_json() == raw["state"]
    assert sorted(p.name for p in (tmp_path / "votes").iterdir()) == ["votes-model.json"]


# ---------------------------------------------------------------------------------------------- memory

def test_memory_store_with_a_fixed_incarnation() -> None:
    store = MemoryVoteStore(incarnation=0)
    assert store.load("model") == AcceptorState(scope="model", incarnation=0)
    assert store.load("stage1").incarnation == 0
    st = _state(incarnation=0)
    store.save(st)
    assert store.load("model") == st
    assert store.load("stage1") == AcceptorState(scope="stage1", incarnation=0), "scopes are apart"
    # a simulation's restart reads the saved JSON back as from a disk
    restarted = MemoryVoteStore(saved=store.saved, incarnation=0)
    assert restarted.load("model") == st
    assert json.loads(store.saved["model"]) == st.to_json()


def test_memory_store_without_a_fixed_incarnation_draws_one() -> None:
    seeded = MemoryVoteStore(rng=random.Random(5))
    draw = random.Random(5)
    first, second = draw.randrange(1 << 40), draw.randrange(1 << 40)
    assert seeded.load("model").incarnation == first
    assert seeded.load("model").incarnation == second, "nothing saved: each load is a new voter"
    st = _state(incarnation=first)
    seeded.save(st)
    assert seeded.load("model") == st
    unseeded = [MemoryVoteStore().load("model").incarnation for _ in range(4)]
    assert all(0 <= x < 1 << 40 for x in unseeded)
    assert len(set(unseeded)) == 4  # 2**40 values: a repeat is (practically) impossible
    # a fresh memory store does not resume what another one saved
    assert MemoryVoteStore(rng=random.Random(5)).load("model").rounds == {}


def test_file_store_draws_a_random_incarnation_for_a_new_book(tmp_path: Path) -> None:
    a = FileVoteStore(tmp_path / "a").load("model").incarnation
    b = FileVoteStore(tmp_path / "b").load("model").incarnation
    assert 0 <= a < 1 << 40 and 0 <= b < 1 << 40 and a != b
