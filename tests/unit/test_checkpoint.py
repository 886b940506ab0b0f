"""Checkpoints: bit-exact round trips, pruning, and rejection of torn/corrupted files with fallback."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.config import ModelConfig
from swarmtrain.models import build_model
from swarmtrain.sync import checkpoint as ckpt
from swarmtrain.sync.checkpoint import (
    CheckpointError,
    join_state,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
    split_state,
)

pytestmark = pytest.mark.unit


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "theta": torch.randn(37, 5, generator=g),
        "momentum": torch.randn(185, generator=g, dtype=torch.float64),
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "step": torch.tensor(float(seed)),  # 0-dim, like AdamW's `step`
        "empty": torch.zeros(0, 3),
        "ints": torch.arange(10, dtype=torch.int64) * seed,
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    meta = {"round": 3, "lr": 0.1 + 0.2, "inf": float("inf"), "data": {"position": 17}, "peers": ["a", "b"]}
    path = save_checkpoint(tmp_path, tensors=_tensors(1), meta=meta)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.path == path
    _assert_same(loaded.tensors, _tensors(1))
    assert loaded.meta == meta


def test_missing_or_empty_directory_has_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path / "nope") is None
    assert load_latest_checkpoint(tmp_path) is None


def test_newest_wins_and_only_keep_survive(tmp_path: Path) -> None:
    for i in range(5):
        save_checkpoint(tmp_path, tensors=_tensors(i), meta={"i": i}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-0000000003.json", "ckpt-0000000004.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".ckpt.lock", "ckpt-0000000003.json", "ckpt-0000000003.safetensors", "ckpt-0000000004.json",
        "ckpt-0000000004.safetensors"]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.meta == {"i": 4}
    _assert_same(loaded.tensors, _tensors(4))


def test_shared_storage_is_saved(tmp_path: Path) -> None:
    model = build_model(ModelConfig(preset="tiny"), seed=0)  # tied embeddings share one storage
    flat = torch.arange(12.0)
    save_checkpoint(tmp_path, tensors={**model.state_dict(), "a": flat[:6], "b": flat[6:]}, meta={})
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    _assert_same({k: loaded.tensors[k] for k in model.state_dict()}, model.state_dict())
    assert torch.equal(loaded.tensors["b"], flat[6:])


def _damage_truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _damage_flip_last_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))


def _damage_manifest_value(p: Path) -> None:
    p.write_text(p.read_text().replace('"i": 1', '"i": 7'))  # still valid JSON, wrong content


@pytest.mark.parametrize(("suffix", "damage", "words"), [
    (".safetensors", _damage_truncate, "torn or corrupted"),
    (".safetensors", _damage_flip_last_byte, "torn or corrupted"),
    (".safetensors", Path.unlink, "missing"),
    (".json", _damage_truncate, "torn or corrupted"),
    (".json", _damage_manifest_value, "checksum does not match"),
])
def test_damaged_newest_is_rejected_and_previous_used(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      suffix: str, damage, words: str) -> None:
    save_checkpoint(tmp_path, tensors=_tensors(0), meta={"i": 0})
    newest = save_checkpoint(tmp_path, tensors=_tensors(1), meta={"i": 1})
    damage(newest.with_suffix(suffix))
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(newest)
    assert newest.stem in str(info.value)
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.meta == {"i": 0}
    _assert_same(loaded.tensors, _tensors(0))
    assert any("rejected checkpoint" in r.message for r in caplog.records)


def test_all_damaged_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    p = save_checkpoint(tmp_path, tensors=_tensors(0), meta={})
    _damage_flip_last_byte(p.with_suffix(".safetensors"))
    with pytest.raises(CheckpointError, match="no checkpoint verifies"):
        load_latest_checkpoint(tmp_path)


def test_wrong_format_version_is_rejected(tmp_path: Path) -> None:
    p = save_checkpoint(tmp_path, tensors=_tensors(0), meta={})
    doc = json.loads(p.read_text())
    doc["body"]["format"] = 99
    doc["body_sha256"] = ckpt._body_digest(doc["body"])
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="format 99"):
        load_checkpoint(p)


class _Crash(Exception):
    pass


def _crash_at(monkeypatch: pytest.MonkeyPatch, op_index: int) -> list[str]:
    """Make the `op_index`-th durable filesystem step of a save raise, as if the process died there."""
    ops: list[str] = []
    real = {"fsync": os.fsync, "replace": os.replace, "unlink": Path.unlink}

    def hook(name: str):
        def wrapped(*args, **kwargs):
            ops.append(name)
            if len(ops) == op_index + 1:
                raise _Crash(name)
            return real[name](*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ckpt.os, "fsync", hook("fsync"))
    monkeypatch.setattr(ckpt.os, "replace", hook("replace"))
    monkeypatch.setattr(Path, "unlink", hook("unlink"))
    return ops


def test_a_crash_at_any_point_of_a_save_leaves_old_or_new_state(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Count the durable steps of one save that also prunes (2 existing, keep=2).
    save_checkpoint(tmp_path / "count", tensors=_tensors(0), meta={"i": 0})
    save_checkpoint(tmp_path / "count", tensors=_tensors(1), meta={"i": 1})
    with monkeypatch.context() as m:
        ops = _crash_at(m, 10_000)
        save_checkpoint(tmp_path / "count", tensors=_tensors(2), meta={"i": 2})
    assert len(ops) >= 8, ops
    for k in range(len(ops)):
        d = tmp_path / f"crash{k}"
        save_checkpoint(d, tensors=_tensors(0), meta={"i": 0})
        save_checkpoint(d, tensors=_tensors(1), meta={"i": 1})
        with monkeypatch.context() as m, pytest.raises(_Crash):
            _crash_at(m, k)
            save_checkpoint(d, tensors=_tensors(2), meta={"i": 2})
        loaded = load_latest_checkpoint(d)
        assert loaded is not None and loaded.meta["i"] in (1, 2), (k, ops[k])
        _assert_same(loaded.tensors, _tensors(loaded.meta["i"]))
        # The next save after a restart cleans up and lands as the newest.
        save_checkpoint(d, tensors=_tensors(3), meta={"i": 3})
        loaded = load_latest_checkpoint(d)
        assert loaded is not None and loaded.meta == {"i": 3}
        assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]
        assert len(list(d.glob("*.safetensors"))) == len(list_checkpoints(d)) == 2


@pytest.mark.parametrize(("meta", "words"), [
    ({"t": torch.zeros(1)}, "Tensor is not JSON"),
    ({"t": {1, 2}}, "set is not JSON"),
    ({"d": {1: "a"}}, "keys must be str"),
])
def test_non_json_meta_is_refused(tmp_path: Path, meta: dict, words: str) -> None:
    with pytest.raises(CheckpointError, match=words):
        save_checkpoint(tmp_path, tensors={}, meta=meta)


def test_bad_tensors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'x'.*not a torch\.Tensor"):
        save_checkpoint(tmp_path, tensors={"x": [1.0]}, meta={})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="keep=0"):
        save_checkpoint(tmp_path, tensors={}, meta={}, keep=0)


def _train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, steps: range) -> None:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (max(steps.stop, 1), 2, 17), generator=g)
    for s in steps:
        _, loss = model(data[s, :, :-1], data[s, :, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _fresh(seed: int = 0):
    model = build_model(ModelConfig(preset="tiny", n_layer=1), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def test_split_state_resumes_training_bit_exactly(tmp_path: Path) -> None:
    ref_model, ref_opt, ref_sched = _fresh()
    _train_steps(ref_model, ref_opt, ref_sched, range(6))

    model, opt, sched = _fresh()
    _train_steps(model, opt, sched, range(3))
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "round": 3}
    tensors, skeleton = split_state(state)
    save_checkpoint(tmp_path, tensors=tensors, meta={"state": skeleton})

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    restored = join_state(loaded.tensors, loaded.meta["state"])
    model2, opt2, sched2 = _fresh(seed=1)
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["opt"])
    sched2.load_state_dict(restored["sched"])
    assert restored["round"] == 3
    _train_steps(model2, opt2, sched2, range(3, 6))
    _assert_same(model2.state_dict(), ref_model.state_dict())


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=5))
_tensor = st.integers(0, 4).map(lambda n: torch.arange(float(n)))
_state = st.recursive(
    st.one_of(_leaf, _tensor),
    lambda kids: st.one_of(st.lists(kids, max_size=3),
                           st.dictionaries(st.text(min_size=1, max_size=4).filter(lambda k: not k.startswith("__")),
                                           kids, max_size=3),
                           st.dictionaries(st.integers(0, 9), kids, max_size=3)),
    max_leaves=12,
)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b and type(a) is type(b)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=4).filter(lambda k: not k.startswith("__")), _state, max_size=4))
def test_split_join_round_trip(state: dict) -> None:
    tensors, skeleton = split_state(state)
    json.dumps(skeleton)
    assert _equal(join_state(tensors, json.loads(json.dumps(skeleton))), state)


def test_split_state_refuses_what_json_cannot_hold() -> None:
    with pytest.raises(CheckpointError, match="a: cannot checkpoint a set"):
        split_state({"a": {1, 2}})
    with pytest.raises(CheckpointError, match="keys must be all str or all int"):
        split_state({"a": {1: 0, "x": 1}})


def test_unrelated_files_in_the_directory_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "identity.key").write_bytes(b"key")
    (tmp_path / "model.safetensors").write_bytes(b"not ours")
    (tmp_path / ".tmp-ckpt-0000000009.safetensors").write_bytes(b"torn")  # ours: an unfinished save
    (tmp_path / "ckpt-0000000008.safetensors").write_bytes(b"orphan")  # ours: payload whose manifest never landed
    for i in range(3):
        save_checkpoint(tmp_path, tensors=_tensors(i), meta={"i": i}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".ckpt.lock", "ckpt-0000000002.json", "ckpt-0000000002.safetensors", "identity.key", "model.safetensors"]


def test_concurrent_saves_into_one_directory_are_serialised(tmp_path: Path) -> None:
    def saver(k: int) -> None:
        for i in range(6):
            save_checkpoint(tmp_path, tensors=_tensors(k * 10 + i), meta={"k": k, "i": i}, keep=3)

    threads = [threading.Thread(target=saver, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    manifests = list_checkpoints(tmp_path)
    assert [p.name for p in manifests] == [f"ckpt-{s:010d}.json" for s in (15, 16, 17)]
    for p in manifests:
        loaded = load_checkpoint(p)
        _assert_same(loaded.tensors, _tensors(loaded.meta["k"] * 10 + loaded.meta["i"]))


def test_a_held_lock_times_out_with_a_clear_error(tmp_path: Path) -> None:
    with open(tmp_path / ".ckpt.lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        with pytest.raises(CheckpointError, match="another save held the checkpoint lock"):
            save_checkpoint(tmp_path, tensors={}, meta={}, lock_timeout_s=0.05)
    save_checkpoint(tmp_path, tensors={}, meta={}, lock_timeout_s=0.05)


def test_directory_claim_is_exclusive_across_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from swarmtrain.sync.checkpoint import claim_directory

    claim = claim_directory(tmp_path)
    probe = (
        "import sys\nfrom swarmtrain.sync.checkpoint import CheckpointError, claim_directory\n"
        "try:\n    claim_directory(sys.argv[1])\nexcept CheckpointError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True)
    assert "in use by another running peer" in out.stdout and str(os.getpid()) in out.stdout
    claim.release()
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout == ""
