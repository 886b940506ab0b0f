"""VoteBook: one vote per round, the fence that makes a round commit at most one mean.

Every member that fetched all of its session's means asks the round's voters for their vote before it
commits; a voter gives its vote of round r to the first session that asks and refuses every other session
of r. A commit needs a strict majority of the voters, so two sessions of one round can never both commit,
whatever the clocks, stalls or retries: two majorities of one set share a voter, and it voted once.

A voter that restarts must not vote again in a round it already voted in: with a path, the book is kept
on disk (written atomically before a vote is granted) and read back at start. Rounds far behind are
forgotten and refused from then on (`forget_before`), which is safe: refusing never adds a commit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

__all__ = ["VoteBook", "VoteBookError"]

log = logging.getLogger(__name__)


class VoteBook:
    """The votes this peer gave, per round; thread-safe. `path` keeps them across restarts."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._votes: dict[int, str] = {}
        self._floor = 0  # rounds below this are refused (forgotten)
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            floor = raw["floor"]
            votes = {int(r): s for r, s in raw["votes"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise VoteBookError(f"{path}: unreadable vote book ({type(e).__name__}: {e}); it records which "
                                f"attempt this peer voted for in each round: restore it or start with a new "
                                f"identity") from None
        if not isinstance(floor, int) or floor < 0 or not all(isinstance(s, str) and s for s in votes.values()):
            raise VoteBookError(f"{path}: malformed vote book (floor {floor!r})")
        self._floor, self._votes = floor, votes

    def vote(self, round_index: int, session_id: str) -> tuple[bool, str]:
        """Give round `round_index`'s vote to `session_id` unless it went elsewhere: (granted, voted_for).

        voted_for is the session holding this round's vote ("" when the round is forgotten: refused)."""
        if not session_id:
            raise ValueError("VoteBook.vote: empty session id")
        with self._lock:
            if round_index < self._floor:
                return False, ""
            held = self._votes.get(round_index)
            if held is None:
                self._votes[round_index] = session_id
                try:
                    self._save()
                except OSError as e:
                    del self._votes[round_index]  # not granted: a vote that could be forgotten is no vote
                    log.error("could not record a vote of round %d in %s: %s", round_index, self.path, e)
                    return False, ""
                return True, session_id
            return held == session_id, held

    def forget_before(self, round_index: int) -> None:
        """Drop the votes of rounds < `round_index` and refuse those rounds from now on."""
        with self._lock:
            if round_index <= self._floor:
                return
            self._floor = round_index
            self._votes = {r: s for r, s in self._votes.items() if r >= round_index}
            try:
                self._save()
            except OSError as e:  # the floor only grows: an older floor on disk refuses less, still safely
                log.warning("could not update the vote book %s: %s", self.path, e)

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps({"floor": self._floor, "votes": {str(r): s for r, s in sorted(self._votes.items())}})
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class VoteBookError(ValueError):
    """The vote book on disk cannot be read: voting from an empty one could vote twice in a round."""
