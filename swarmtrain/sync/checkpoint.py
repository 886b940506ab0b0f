"""Crash-safe checkpoints of a peer's whole state: safetensors payload + self-checked JSON manifest.

A checkpoint `ckpt-<seq>` is two files in one directory:

* `ckpt-<seq>.safetensors` — every tensor (θ_global, outer momentum, inner optimizer state, ...);
* `ckpt-<seq>.json` — the manifest: the caller's JSON metadata, the payload's size and sha256,
  and a sha256 of the manifest body itself.

Each file is written to a temp file in the same directory, flushed, fsynced and renamed; the
directory is fsynced after each rename. The manifest is renamed last, so it is the commit point:
a payload without a manifest is an unfinished save (a kill mid-save) and is ignored; a manifest or
payload whose checksum does not match is a torn or corrupted checkpoint and is rejected with a
`CheckpointError` naming the file, and `load_latest_checkpoint` falls back to the previous good one.

`split_state`/`join_state` turn a nested state (dicts, lists, tensors, JSON scalars; e.g. a torch
optimizer's `state_dict()`) into (flat tensors, JSON skeleton) and back, so any `state_dict()`
can be checkpointed without pickle.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = [
    "CheckpointError",
    "DirectoryClaim",
    "LoadedCheckpoint",
    "claim_directory",
    "join_state",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "save_checkpoint",
    "split_state",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{10})\.json$")
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".ckpt.lock"
_CLAIM_NAME = ".peer.lock"
_FILE = re.compile(r"^(\.tmp-)?(ckpt-\d{10})\.(json|safetensors)$")  # every file a save may leave behind
_HASH_CHUNK_BYTES = 8 << 20
_TENSOR_TAG = "__tensor__"
_INT_KEYS_TAG = "__int_keys__"


class CheckpointError(ValueError):
    """A checkpoint is torn, corrupted or unreadable, or a state cannot be checkpointed; names which."""


class LoadedCheckpoint(NamedTuple):
    """One verified checkpoint: its tensors, the caller's metadata, and the manifest it came from."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path


# ---------------------------------------------------------------- save


def save_checkpoint(directory: str | os.PathLike[str], *, tensors: Mapping[str, torch.Tensor],
                    meta: Mapping[str, Any], keep: int = 2, lock_timeout_s: float = 60.0) -> Path:
    """Atomically write a new newest checkpoint and prune all but the newest `keep`; returns its manifest path.

    Saves into one directory are serialised by an advisory lock (threads and processes alike);
    waiting longer than `lock_timeout_s` for it is a CheckpointError.
    """
    if keep < 1:
        raise CheckpointError(f"keep={keep}: must be >= 1")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root, timeout_s=lock_timeout_s):
        return _save_locked(root, tensors=tensors, meta=meta, keep=keep)


@contextlib.contextmanager
def _locked(root: Path, *, timeout_s: float) -> Iterator[None]:
    with open(root / _LOCK_NAME, "a+b") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{root}: another save held the checkpoint lock for over "
                                          f"{timeout_s:.1f}s") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class DirectoryClaim:
    """Exclusive, process-lifetime ownership of a checkpoint directory (released by `release()` or exit)."""

    def __init__(self, root: Path, handle: Any) -> None:
        self.root = root
        self._handle = handle

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()


def claim_directory(directory: str | os.PathLike[str]) -> DirectoryClaim:
    """Claim `directory` for one live peer; a second live claimant gets a CheckpointError naming the holder.

    Two processes sharing a checkpoint directory (and so one identity) would overwrite each
    other's state; the kernel drops the claim when the process dies, so a SIGKILLed peer's
    restart is never locked out.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / _CLAIM_NAME, "a+")  # noqa: SIM115 - held for the claim's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise CheckpointError(f"checkpoint.dir {root} is in use by another running peer (pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return DirectoryClaim(root, handle)


def _save_locked(root: Path, *, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], keep: int) -> Path:
    meta = _check_json(dict(meta))
    prepared = _prepare_tensors(tensors)
    _remove_leftovers(root)
    existing = list_checkpoints(root)
    seq = _seq_of(existing[-1]) + 1 if existing else 0
    payload = root / f"ckpt-{seq:010d}.safetensors"
    manifest = root / f"ckpt-{seq:010d}.json"

    tmp_payload = root / f"{_TMP_PREFIX}{payload.name}"
    save_file(prepared, str(tmp_payload))
    _fsync_path(tmp_payload)
    size_bytes, digest = _file_digest(tmp_payload)
    os.replace(tmp_payload, payload)
    _fsync_path(root)

    body = {"format": FORMAT_VERSION, "payload": payload.name, "payload_size_bytes": size_bytes,
            "payload_sha256": digest, "meta": meta}
    text = json.dumps({"body": body, "body_sha256": _body_digest(body)}, sort_keys=True, indent=1)
    _write_atomic(manifest, text.encode("utf-8"))
    log.info("checkpoint %s saved (%d bytes)", manifest, size_bytes)
    _prune(root, keep=keep)
    return manifest


def _prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, no shared storage (safetensors refuses aliased tensors, e.g. tied embeddings)."""
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor name {name!r}: must be a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor {name!r}: is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            storage = t.untyped_storage().data_ptr()
            if storage in seen_storages:
                t = t.clone()
            seen_storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _check_json(meta: dict[str, Any]) -> dict[str, Any]:
    """JSON values only, str keys only (int keys would come back as str); tuples come back as lists."""

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"checkpoint meta {path}/{k!r}: keys must be str (use split_state)")
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        elif not (obj is None or isinstance(obj, (bool, int, float, str))):
            raise CheckpointError(f"checkpoint meta {path or '<root>'}: a {type(obj).__name__} is not JSON "
                                  "(tensors go in `tensors`; or use split_state)")

    walk(meta, "")
    return meta


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_leftovers(root: Path) -> None:
    """Temp files and payloads whose manifest never landed are unfinished saves from a killed run."""
    manifests = {p.stem for p in list_checkpoints(root)}
    for p in root.iterdir():
        m = _FILE.match(p.name)
        unfinished = m is not None and (m.group(1) is not None
                                        or (m.group(3) == "safetensors" and m.group(2) not in manifests))
        if unfinished and p.is_file():
            log.info("removing unfinished checkpoint file %s", p)
            p.unlink()


def _prune(root: Path, *, keep: int) -> None:
    for manifest in list_checkpoints(root)[:-keep]:
        # Manifest first: a kill in between leaves an orphan payload, never a manifest without payload.
        manifest.unlink()
        with contextlib.suppress(FileNotFoundError):
            manifest.with_suffix(".safetensors").unlink()
    _fsync_path(root)


# ---------------------------------------------------------------- load


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Manifest paths of the checkpoints in `directory`, oldest first (unverified)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME.match(p.name)), key=_seq_of)


def _seq_of(manifest: Path) -> int:
    m = _NAME.match(manifest.name)
    assert m is not None, manifest
    return int(m.group(1))


def load_checkpoint(manifest: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Load and verify one checkpoint by its manifest path; any damage raises CheckpointError."""
    path = Path(manifest)
    body = _read_manifest(path)
    payload = path.with_name(str(body["payload"]))
    if not payload.is_file():
        raise CheckpointError(f"{payload}: payload of checkpoint {path.name} is missing")
    size_bytes, digest = _file_digest(payload)
    if size_bytes != body["payload_size_bytes"] or digest != body["payload_sha256"]:
        raise CheckpointError(f"{payload}: payload is torn or corrupted ({size_bytes} bytes, sha256 {digest[:12]}; "
                              f"manifest says {body['payload_size_bytes']} bytes, "
                              f"sha256 {str(body['payload_sha256'])[:12]})")
    try:
        tensors = load_file(str(payload))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{payload}: not a readable safetensors file ({e})") from e
    return LoadedCheckpoint(tensors=tensors, meta=body["meta"], path=path)


def load_latest_checkpoint(directory: str | os.PathLike[str]) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies; damaged newer ones are logged and skipped.

    Returns None when the directory holds no checkpoint at all; raises CheckpointError when
    checkpoints exist but none verifies (starting from scratch would silently lose the run).
    """
    manifests = list_checkpoints(directory)
    errors: list[str] = []
    for manifest in reversed(manifests):
        try:
            loaded = load_checkpoint(manifest)
        except CheckpointError as e:
            log.warning("rejected checkpoint: %s; trying the previous one", e)
            errors.append(str(e))
            continue
        return loaded
    if errors:
        raise CheckpointError(f"{directory}: no checkpoint verifies: " + "; ".join(errors))
    return None


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: checkpoint manifest not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: manifest is torn or corrupted ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict) or "body_sha256" not in doc:
        raise CheckpointError(f"{path}: manifest is missing its body or checksum")
    body = doc["body"]
    if _body_digest(body) != doc["body_sha256"]:
        raise CheckpointError(f"{path}: manifest is corrupted (its checksum does not match)")
    if body.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {body.get('format')!r} is not {FORMAT_VERSION}")
    return body


def _body_digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _file_digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# ---------------------------------------------------------------- nested state <-> (tensors, JSON)


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a nested state into flat named tensors and a JSON skeleton that refers to them."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        path = path.lstrip("/")
        if isinstance(obj, torch.Tensor):
            tensors[path] = obj
            return {_TENSOR_TAG: path}
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj):
                if _TENSOR_TAG in obj or _INT_KEYS_TAG in obj:
                    raise CheckpointError(f"{path or '<root>'}: key {_TENSOR_TAG!r}/{_INT_KEYS_TAG!r} is reserved")
                return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
            if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
                return {_INT_KEYS_TAG: [[k, walk(v, f"{path}/{k}")] for k, v in obj.items()]}
            raise CheckpointError(f"{path or '<root>'}: dict keys must be all str or all int, got {list(obj)[:5]}")
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise CheckpointError(f"{path or '<root>'}: cannot checkpoint a {type(obj).__name__} (tensors, dicts, "
                              "lists and JSON scalars only)")

    skeleton = walk(state, "")
    return tensors, skeleton


def join_state(tensors: Mapping[str, torch.Tensor], skeleton: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `split_state` (tuples come back as lists)."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if _TENSOR_TAG in obj:
                name = obj[_TENSOR_TAG]
                if name not in tensors:
                    raise CheckpointError(f"tensor {name!r} named by the checkpoint's metadata is missing")
                return tensors[name]
            if _INT_KEYS_TAG in obj:
                return {int(k): walk(v) for k, v in obj[_INT_KEYS_TAG]}
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    out = walk(dict(skeleton))
    assert isinstance(out, dict)
    return out
