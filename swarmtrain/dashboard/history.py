"""The dashboard's history in SQLite (stdlib sqlite3): peers seen, one sample per peer and round, the rounds
timeline (one row per round and part, kept up to date as samples come in, so reading 10,000 rounds of
200 peers reads 10,000 rows) and aborts. A file next to the coordinator's state, so a restarted
coordinator keeps its charts; retention is bounded to the newest `retention_rounds` rounds.

One connection, used from the coordinator's event loop thread only (the dashboard's handlers run there);
every write is one transaction.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmtrain.discovery.records import PeerRecord

__all__ = ["History", "Sample"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL, record TEXT NOT NULL,
    invalid TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS samples (
    peer_id TEXT NOT NULL, part INTEGER NOT NULL, round INTEGER NOT NULL, at REAL NOT NULL,
    state_hash TEXT NOT NULL, loss REAL, val_loss REAL, tokens INTEGER NOT NULL, tokens_per_s REAL NOT NULL,
    bytes INTEGER NOT NULL, compute_s REAL NOT NULL, comm_s REAL NOT NULL,
    PRIMARY KEY (peer_id, part, round));
CREATE INDEX IF NOT EXISTS samples_by_round ON samples (round);
CREATE TABLE IF NOT EXISTS aborts (
    peer_id TEXT NOT NULL, part INTEGER NOT NULL, round INTEGER NOT NULL, at REAL NOT NULL, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS aborts_by_round ON aborts (round);
CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, value REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER NOT NULL, part INTEGER NOT NULL, members INTEGER NOT NULL, hashes TEXT NOT NULL,
    loss_sum REAL NOT NULL, loss_n INTEGER NOT NULL, val_sum REAL NOT NULL, val_n INTEGER NOT NULL,
    tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, comm_sum REAL NOT NULL, compute_s REAL NOT NULL,
    first_at REAL NOT NULL, spread_sum REAL NOT NULL DEFAULT 0, spread_n INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (round, part));
"""
# Columns added since the first schema: (table, column, definition), added to a history file that lacks them.
_ADDED = (("rounds", "spread_sum", "REAL NOT NULL DEFAULT 0"), ("rounds", "spread_n", "INTEGER NOT NULL DEFAULT 0"))
TOTALS = ("samples", "aborts", "tokens", "bytes")  # monotonic sums over every sample ever added (metrics)


@dataclass(frozen=True)
class Sample:
    """What one peer reported once it reached `round` (its record's cumulative stats then, and deltas)."""

    peer_id: str
    part: int  # -2: the whole model (a DiLoCo worker); a pipeline stage; -1: a pipeline's ends
    round: int
    at: float
    state_hash: str
    loss: float | None
    val_loss: float | None
    tokens: int  # since the peer's previous sample
    tokens_per_s: float
    bytes: int  # sent + received since its previous sample
    compute_s: float  # since its previous sample
    comm_s: float
    spread: float | None = None  # gossip: its last round's distance to its partners (discovery/stats.py)


class History:
    def __init__(self, path: str | Path, *, retention_rounds: int) -> None:
        if retention_rounds < 1:
            raise ValueError(f"retention_rounds must be >= 1, got {retention_rounds}")
        self.path = str(path)
        self.retention_rounds = retention_rounds
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        for table, column, definition in _ADDED:
            if column not in {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    def close(self) -> None:
        self.db.close()

    # -- writes ---------------------------------------------------------------------------------------
    def see(self, records: Iterable[tuple[PeerRecord, str]], *, at: float) -> None:
        """Upsert the live peers' records (with why each is invalid, "" if it is not)."""
        rows = [(r.peer_id, at, at, json.dumps(r.to_json()), invalid) for r, invalid in records]
        with self._transaction():
            self.db.executemany(
                "INSERT INTO peers VALUES (?, ?, ?, ?, ?) ON CONFLICT(peer_id) DO UPDATE SET "
                "last_seen = excluded.last_seen, record = excluded.record, invalid = excluded.invalid", rows)

    def add(self, samples: Sequence[Sample], aborts: Sequence[tuple[str, int, int, float, str]] = ()) -> None:
        """New samples (a peer reached a round) and aborts ((peer, part, round, at, reason)); then trim."""
        with self._transaction():
            fresh = []
            for s in samples:
                cur = self.db.execute(
                    "INSERT OR IGNORE INTO samples VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (s.peer_id, s.part, s.round, s.at, s.state_hash, s.loss, s.val_loss, s.tokens, s.tokens_per_s,
                     s.bytes, s.compute_s, s.comm_s))
                if cur.rowcount:
                    fresh.append(s)
            for s in fresh:
                self._count_in_round(s)
            samples = fresh
            self.db.executemany("INSERT INTO aborts VALUES (?, ?, ?, ?, ?)", aborts)
            for name, value in (("samples", len(samples)), ("aborts", len(aborts)),
                                ("tokens", sum(s.tokens for s in samples)), ("bytes", sum(s.bytes for s in samples))):
                self.db.execute("INSERT INTO totals VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
                                (name, value, value))
            newest = self.db.execute("SELECT MAX(round) FROM samples").fetchone()[0]
            if newest is not None and newest >= self.retention_rounds:
                floor = newest - self.retention_rounds + 1
                for table in ("samples", "aborts", "rounds"):
                    self.db.execute(f"DELETE FROM {table} WHERE round < ?", (floor,))

    def _count_in_round(self, s: Sample) -> None:
        row = self.db.execute("SELECT hashes FROM rounds WHERE round = ? AND part = ?", (s.round, s.part)).fetchone()
        hashes = sorted(set(json.loads(row[0]) if row else []) | {s.state_hash})
        loss, val = (s.loss, 1) if s.loss is not None else (0.0, 0), (s.val_loss, 1) if s.val_loss is not None \
            else (0.0, 0)
        spread = (s.spread, 1) if s.spread is not None else (0.0, 0)
        if row is None:
            self.db.execute("INSERT INTO rounds (round, part, members, hashes, loss_sum, loss_n, val_sum, val_n, "
                            "tokens, bytes, comm_sum, compute_s, first_at, spread_sum, spread_n) "
                            "VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (s.round, s.part, json.dumps(hashes), loss[0], loss[1], val[0], val[1], s.tokens,
                             s.bytes, s.comm_s, s.compute_s, s.at, spread[0], spread[1]))
        else:
            self.db.execute(
                "UPDATE rounds SET members = members + 1, hashes = ?, loss_sum = loss_sum + ?, loss_n = loss_n + ?, "
                "val_sum = val_sum + ?, val_n = val_n + ?, tokens = tokens + ?, bytes = bytes + ?, "
                "comm_sum = comm_sum + ?, compute_s = compute_s + ?, first_at = MIN(first_at, ?), "
                "spread_sum = spread_sum + ?, spread_n = spread_n + ? WHERE round = ? AND part = ?",
                (json.dumps(hashes), loss[0], loss[1], val[0], val[1], s.tokens, s.bytes, s.comm_s, s.compute_s,
                 s.at, spread[0], spread[1], s.round, s.part))

    # -- reads ----------------------------------------------------------------------------------------
    def peers(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT peer_id, first_seen, last_seen, record, invalid FROM peers ORDER BY peer_id")
        return [{"peer_id": p, "first_seen": f, "last_seen": last, "record": json.loads(rec), "invalid": inv}
                for p, f, last, rec, inv in rows]

    def totals(self) -> dict[str, float]:
        got = dict(self.db.execute("SELECT name, value FROM totals").fetchall())
        return {name: float(got.get(name, 0.0)) for name in TOTALS}

    def rounds_json(self, *, since: int, limit: int) -> str:
        """The timeline from round `since` as a JSON array, oldest first: per round and part, its members,
        hashes, mean losses, sums and aborts. Built by SQLite's JSON functions: 10,000 rows without a Python
        object per row (the API's biggest answer)."""
        row = self.db.execute(
            "SELECT json_group_array(json_object("
            "'round', r.round, 'part', r.part, 'members', r.members, 'hashes', json(r.hashes),"
            "'loss', CASE WHEN r.loss_n > 0 THEN r.loss_sum / r.loss_n END,"
            "'val_loss', CASE WHEN r.val_n > 0 THEN r.val_sum / r.val_n END,"
            "'spread', CASE WHEN r.spread_n > 0 THEN r.spread_sum / r.spread_n END,"
            "'tokens', r.tokens, 'bytes', r.bytes, 'comm_s', r.comm_sum / r.members, 'compute_s', r.compute_s,"
            "'at', r.first_at, 'aborts', (SELECT json_group_array(json_object('peer', a.peer_id, 'at', a.at,"
            "'reason', a.reason)) FROM (SELECT * FROM aborts WHERE round = r.round AND part = r.part ORDER BY at) a)))"
            " FROM (SELECT * FROM rounds WHERE round >= ? ORDER BY round, part LIMIT ?) r", (since, limit)).fetchone()
        return str(row[0])

    def rounds(self, *, since: int, limit: int) -> list[dict[str, Any]]:
        """`rounds_json` decoded."""
        out: list[dict[str, Any]] = json.loads(self.rounds_json(since=since, limit=limit))
        return out

    def members(self, round_index: int, part: int) -> list[str]:
        """The peers sampled at a round of a part."""
        return [p for (p,) in self.db.execute("SELECT peer_id FROM samples WHERE round = ? AND part = ? ORDER BY "
                                              "peer_id", (round_index, part))]

    def newest_round_at(self) -> float | None:
        """When the newest round's first sample came in."""
        row = self.db.execute("SELECT first_at FROM rounds ORDER BY round DESC LIMIT 1").fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def comm_histogram(self, bounds: Sequence[float]) -> tuple[list[int], float]:
        """The kept samples' averaging seconds (> 0) per bucket (`bounds` upper bounds, then +Inf), and their sum:
        counted in SQL, so a restart with millions of samples does not read them one by one."""
        cases = ", ".join(f"SUM(comm_s > {lo!r} AND comm_s <= {hi!r})"
                          for lo, hi in zip((0.0, *bounds[:-1]), bounds, strict=True))
        row = self.db.execute(f"SELECT {cases}, SUM(comm_s > {bounds[-1]!r}), SUM(comm_s) FROM samples "
                              "WHERE comm_s > 0").fetchone()
        return [int(x or 0) for x in row[:-1]], float(row[-1] or 0.0)

    def _transaction(self) -> _Transaction:
        return _Transaction(self.db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
