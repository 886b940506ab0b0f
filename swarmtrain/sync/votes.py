"""Where a voter keeps its votes: one crash-safe file per averaging scope in the checkpoint directory (written
and fsynced, renamed, the directory fsynced, before any grant leaves the peer), or memory only.

One file per plane (`votes-model.json` for a DiLoCo worker, `votes-stage2.json`, `votes-ends.json` for
pipeline parts): a stage server that moves keeps the votes of every stage it served apart. A store that
cannot be read is an error, never an empty book: voting from an empty book could grant twice in a round.
A new store (no file yet) and a memory store start at a random incarnation, so a voter whose votes were
lost (no checkpoint directory, or a new one) can never be taken for the incarnation that cast them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from pathlib import Path
from typing import Protocol

from swarmtrain.round.acceptor import AcceptorState
from swarmtrain.round.ballots import BallotError

__all__ = ["FileVoteStore", "MemoryVoteStore", "VoteStore", "VoteStoreError", "votes_file"]

log = logging.getLogger(__name__)

FORMAT = 2
MAX_STORE_BYTES = 16 << 20


class VoteStoreError(ValueError):
    """The votes on disk cannot be read or written; the message names the file."""


class VoteStore(Protocol):
    """A voter's durable state: `load` once at start, `save` before every answer that grants."""

    def load(self, scope: str) -> AcceptorState: ...

    def save(self, state: AcceptorState) -> None: ...


def votes_file(directory: str | os.PathLike[str], scope: str) -> Path:
    return Path(directory) / f"votes-{scope or 'model'}.json"


def _fresh(scope: str, rng: random.Random | None, incarnation: int | None = None) -> AcceptorState:
    if incarnation is None:
        incarnation = (rng or random.SystemRandom()).randrange(1 << 40)
    return AcceptorState(scope=scope, incarnation=incarnation)


class MemoryVoteStore:
    """Votes in memory (no checkpoint directory): they die with the process, and so does the incarnation.

    `saved` is the JSON as last saved, which a simulation's restart reads back as a disk would; `incarnation`
    fixes the first one (a fixed group in a test or a benchmark, where every member is known as incarnation 0)."""

    def __init__(self, *, rng: random.Random | None = None, saved: dict[str, str] | None = None,
                 incarnation: int | None = None) -> None:
        self.rng = rng
        self.incarnation = incarnation
        self.saved: dict[str, str] = saved if saved is not None else {}

    def load(self, scope: str) -> AcceptorState:
        raw = self.saved.get(scope)
        if raw is None:
            return _fresh(scope, self.rng, self.incarnation)
        return AcceptorState.from_json(json.loads(raw))

    def save(self, state: AcceptorState) -> None:
        self.saved[state.scope] = json.dumps(state.to_json())


class FileVoteStore:
    """Votes in `directory` (created when missing), one file per scope."""

    def __init__(self, directory: str | os.PathLike[str], *, rng: random.Random | None = None) -> None:
        self.directory = Path(directory)
        self.rng = rng
        self._writing = threading.Lock()

    def load(self, scope: str) -> AcceptorState:
        path = votes_file(self.directory, scope)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return _fresh(scope, self.rng)
        except OSError as e:
            raise VoteStoreError(f"{path}: cannot read the vote book: {e}") from None
        if size > MAX_STORE_BYTES:
            raise VoteStoreError(f"{path}: {size} bytes, more than a vote book holds; restore it or remove the "
                                 f"checkpoint directory's identity")
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise BallotError(f"format {raw.get('format') if isinstance(raw, dict) else None!r}, this code "
                                  f"reads {FORMAT}")
            state = AcceptorState.from_json(raw.get("state"))
        except (OSError, ValueError) as e:
            raise VoteStoreError(f"{path}: unreadable vote book ({e}); it records what this peer voted for in each "
                                 f"round: restore it, or start this peer with a new checkpoint directory") from None
        if state.scope != scope:
            raise VoteStoreError(f"{path}: holds the votes of scope {state.scope!r}, not {scope!r}")
        return state

    def save(self, state: AcceptorState) -> None:
        """Write `state` durably: a temporary file fsynced, renamed over the book, the directory fsynced. One
        write at a time per store (each through its own temporary file)."""
        path = votes_file(self.directory, state.scope)
        data = json.dumps({"format": FORMAT, "state": state.to_json()}, separators=(",", ":")).encode()
        with self._writing:
            self._write(path, data)

    def _write(self, path: Path, data: bytes) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_directory(self.directory)
        except OSError as e:
            raise VoteStoreError(f"{path}: cannot record a vote: {e}") from None


def _fsync_directory(directory: Path) -> None:
    """The rename is durable only once the directory entry is (a power loss could otherwise undo it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
